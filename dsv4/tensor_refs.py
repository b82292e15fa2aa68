"""Tensors of a model directory that lie in another file, read where they are.

A converted GGUF keeps its quantized blocks in the .gguf (config.json's `dsv4.tensors`), as
the Engram tables already are, so converting a 150-480 GB file writes a few GB:

    "layers.0.ffn.experts.w1.weight": {"file": "/models/q2.gguf", "offset": 1234567,
                                       "dtype": "U8", "shape": [384, 2304, 1320]}
    "...": {"parts": ["/m/q4.gguf.part1", "/m/q4.gguf.part2"], "offset": ..., ...}

`file` (or each of `parts`, the raw byte split of one file, the offset running over all of
them) is relative to the model directory unless absolute. A tensor is a read-only memory map
of its bytes; one that straddles two parts is copied together.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from .safetensors_file import STORAGE, CheckpointError


def recorded_path(path: Path | str, base_dir: Optional[Path | str]) -> str:
    """How a reference records `path` (a tensor's or an Engram table's file): relative to the
    model directory `base_dir` when it lies inside it, else absolute."""
    path = Path(path).resolve()
    if base_dir is not None:
        try:
            return path.relative_to(Path(base_dir).resolve()).as_posix()
        except ValueError:
            pass
    return str(path)


def _field(ref: Mapping, key: str, kind, where: str):
    value = ref.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CheckpointError(f"{where}: field {key!r} is {value!r}, expected {kind.__name__}")
    return value


def locate(name: str, ref: Mapping, base_dir: Path) -> tuple[list[Path], int, str, tuple[int, ...]]:
    """Where the referenced tensor `name` lies, checked: (its file or parts, the first byte,
    its dtype, its shape), or a CheckpointError naming the tensor, the file and what is wrong."""
    where = f"{base_dir / 'config.json'}: tensor {name}"
    if not isinstance(ref, Mapping):
        raise CheckpointError(f"{where}: its reference is {ref!r}, expected an object")
    dtype = _field(ref, "dtype", str, where)
    if dtype not in STORAGE:
        raise CheckpointError(f"{where}: dtype {dtype!r} is not a safetensors dtype")
    shape = tuple(_field(ref, "shape", list, where))
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape {list(shape)} is not a list of sizes")
    offset = _field(ref, "offset", int, where)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(STORAGE[dtype]).itemsize
    names = [ref["file"]] if "file" in ref else ref.get("parts")
    if not isinstance(names, list) or not names or not all(isinstance(p, str) for p in names):
        raise CheckpointError(f"{where}: needs a 'file' name or a non-empty list of 'parts'")
    paths = [Path(p) if Path(p).is_absolute() else base_dir / p for p in names]
    sizes = []
    for path in paths:
        if not path.is_file():
            raise CheckpointError(f"{where}: {path} not found (the model directory reads this "
                                  f"tensor where the converter found it)")
        sizes.append(os.stat(path).st_size)
    if offset < 0 or offset + nbytes > sum(sizes):
        raise CheckpointError(f"{where}: bytes {offset}..{offset + nbytes} lie past the end of "
                              f"{' + '.join(map(str, paths))} ({sum(sizes)} bytes): truncated or replaced?")
    return paths, offset, dtype, shape


def read(name: str, ref: Mapping, base_dir: Path) -> np.ndarray:
    """The referenced tensor `name` in its storage dtype (see `locate` for its errors)."""
    paths, offset, dtype, shape = locate(name, ref, base_dir)
    storage = np.dtype(STORAGE[dtype])
    nbytes = int(np.prod(shape, dtype=np.int64)) * storage.itemsize
    pieces, start = [], 0
    for path in paths:
        size = os.stat(path).st_size
        lo, hi = max(offset, start), min(offset + nbytes, start + size)
        if lo < hi:
            pieces.append(np.memmap(path, np.uint8, mode="r", offset=lo - start, shape=(hi - lo,)))
        start += size
    raw = pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.zeros(0, np.uint8)
    return raw.view(storage).reshape(shape)
