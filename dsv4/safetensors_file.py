"""Zero-copy reading and exact writing of safetensors files, fp8 dtypes included.

numpy has no fp8, so tensors are handed out in their storage form: F8_E4M3 and
F8_E8M0 as uint8, BF16 as uint16 (see `to_mx` for MLX arrays). Offsets are
absolute file offsets (64-bit), which the Engram store uses to pread rows.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

import numpy as np
from .config import read_json
from .errors import InputError

# safetensors dtype -> numpy storage dtype
STORAGE = {
    "F8_E4M3": np.uint8,
    "F8_E5M2": np.uint8,
    "F8_E8M0": np.uint8,
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "U16": np.uint16,
    "BF16": np.uint16,
    "F16": np.float16,
    "I32": np.int32,
    "U32": np.uint32,
    "F32": np.float32,
    "I64": np.int64,
    "U64": np.uint64,
    "F64": np.float64,
}


class CheckpointError(InputError):
    """A checkpoint file is not what it must be; the message names file and tensor."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset of the first element in `file`
    nbytes: int

    @property
    def storage(self) -> np.dtype:
        return np.dtype(STORAGE[self.dtype])


def read_header(path: Path | str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors of one safetensors file and its metadata, checked against the file size."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise CheckpointError(f"{path}: header length {n} does not fit in a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    tensors = {}
    for name, entry in header.items():
        dtype = entry.get("dtype")
        if dtype not in STORAGE:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype!r}")
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(STORAGE[dtype]).itemsize
        if end - begin != expected:
            raise CheckpointError(
                f"{path}: tensor {name} {dtype}{list(shape)} needs {expected} bytes, "
                f"the header gives {end - begin}")
        if base + end > size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name} ends at byte {base + end}, "
                f"the file has {size} bytes")
        tensors[name] = TensorInfo(name, dtype, shape, path, base + begin, end - begin)
    return tensors, meta


def view(info: TensorInfo) -> np.ndarray:
    """A read-only memory map of the tensor in its storage dtype (no copy)."""
    if info.nbytes == 0:
        return np.zeros(info.shape, info.storage)
    return np.memmap(info.file, dtype=info.storage, mode="r", offset=info.offset, shape=info.shape)


def to_mx(array: np.ndarray, dtype: str):
    """A storage array as an MLX array: BF16 as bfloat16, F16/F32 as such, fp8 as uint8 codes."""
    import mlx.core as mx

    out = mx.array(np.ascontiguousarray(array))
    return out.view(mx.bfloat16) if dtype == "BF16" else out


class Checkpoint:
    """The tensors of a directory of safetensors shards (with or without an index)."""

    def __init__(self, directory: Path | str, pattern: str = "*.safetensors",
                 index: str = "model.safetensors.index.json"):
        """The files `index` lists, else those matching `pattern`."""
        self.directory = Path(directory)
        index = self.directory / index
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no weight_map object")
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.directory / f).is_file()]
            if missing:
                raise CheckpointError(f"{index}: lists shards that are missing: {missing}")
        else:
            weight_map = None
            files = sorted(p.name for p in self.directory.glob(pattern))
            if not files:
                raise CheckpointError(f"{self.directory}: no safetensors files")
        self.tensors: dict[str, TensorInfo] = {}
        for name in files:
            infos, _ = read_header(self.directory / name)
            self.tensors.update(infos)
        if weight_map is not None:
            for name, file in weight_map.items():
                info = self.tensors.get(name)
                if info is None or info.file.name != file:
                    raise CheckpointError(
                        f"{index}: tensor {name} is listed in {file} but is not in that file")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.directory}: tensor {name} is missing") from None

    def names(self) -> Iterable[str]:
        return self.tensors.keys()


def dtype_name(array: np.ndarray, hint: Optional[str] = None) -> str:
    """The safetensors dtype of a storage array; `hint` names fp8/bf16 codes stored as ints."""
    if hint is not None:
        if np.dtype(STORAGE[hint]) != array.dtype:
            raise ValueError(f"{hint} must be stored as {np.dtype(STORAGE[hint])}, got {array.dtype}")
        return hint
    for name, storage in STORAGE.items():
        if name in ("F8_E4M3", "F8_E5M2", "F8_E8M0", "BF16"):
            continue
        if np.dtype(storage) == array.dtype:
            return name
    raise ValueError(f"no safetensors dtype for {array.dtype}")


def write(path: Path | str, tensors: Mapping[str, tuple[str, np.ndarray]],
          metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write {name: (safetensors dtype, storage array)} exactly as given, in name order."""
    path = Path(path)
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    order = sorted(tensors)
    for name in order:
        dtype, array = tensors[name]
        dtype_name(array, dtype)
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in order:
            f.write(np.ascontiguousarray(tensors[name][1]).tobytes())
        f.flush()
        os.fsync(f.fileno())
