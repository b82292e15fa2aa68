"""Reading a shard of a stored tensor and nothing else of it.

A tensor lies row-major from a byte offset of a file (or of the raw byte split of one file,
its parts). The shard [start, stop) along one axis is, for every index of the axes before it,
one run of bytes: each run is read with pread into the shard's own buffer when it is long;
short runs (columns of a narrow tensor) are read a block of whole rows at a time (at most
BLOCK_BYTES) and their runs copied out, so memory never holds more than the shard and one
block. Every read is logged (`Log`): which tensor, which shard, how many bytes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from . import SINGLE, Shard
from .. import tensor_refs
from ..safetensors_file import STORAGE, CheckpointError, view

DIRECT_RUN = 1 << 16      # runs at least this long are read on their own
BLOCK_BYTES = 1 << 23     # a block of whole rows read for shorter runs


@dataclass
class Log:
    """What one rank read: {tensor name: (shard, bytes kept)}, and the bytes read from files
    (more than kept only where short runs were read with their rows)."""
    tensors: dict = field(default_factory=dict)
    read_bytes: int = 0

    @property
    def kept_bytes(self) -> int:
        return sum(n for _, n in self.tensors.values())


class _Bytes:
    """The bytes of one file, or of the parts of a byte-split file, read by absolute offset."""

    def __init__(self, paths: Sequence[Path]):
        self.paths = [Path(p) for p in paths]
        self.ends = np.cumsum([os.stat(p).st_size for p in self.paths]).tolist()
        self.files: dict[int, int] = {}

    def read_into(self, offset: int, out: memoryview, name: str) -> None:
        pos, done, start = offset, 0, 0
        for i, end in enumerate(self.ends):
            while start <= pos < end and done < len(out):
                if i not in self.files:
                    self.files[i] = os.open(self.paths[i], os.O_RDONLY)
                n = os.preadv(self.files[i], [out[done:done + end - pos]], pos - start)
                if n <= 0:
                    break
                done, pos = done + n, pos + n
            start = end
        if done < len(out):
            raise CheckpointError(f"{self.paths[-1]}: tensor {name}: bytes {offset}..{offset + len(out)} "
                                  f"lie past the end of the file (read {done})")

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()


def shard_shape(shape: tuple[int, ...], shard: Shard) -> tuple[int, ...]:
    if shard.axis is None:
        return tuple(shape)
    return (*shape[:shard.axis], shard.stop - shard.start, *shape[shard.axis + 1:])


def read(name: str, paths: Sequence[Path], offset: int, storage: np.dtype, shape: tuple[int, ...],
         shard: Optional[Shard], log: Optional[Log] = None) -> Optional[np.ndarray]:
    """The shard of the tensor `name` (storage dtype, stored `shape`) at byte `offset` of
    `paths`, as a new array; None when the shard is None (the rank does not hold it)."""
    if shard is None:
        return None
    storage = np.dtype(storage)
    out = np.empty(shard_shape(shape, shard), storage)
    axis = 0 if shard.axis is None else shard.axis
    lo, hi = (0, shape[0] if shape else 1) if shard.axis is None else (shard.start, shard.stop)
    inner = math.prod(shape[axis + 1:]) * storage.itemsize     # bytes of one index of the axis
    outer = math.prod(shape[:axis])
    stride, run = (shape[axis] if shape else 1) * inner, (hi - lo) * inner
    source, dest = _Bytes(paths), memoryview(out.reshape(-1).view(np.uint8))
    try:
        read_bytes = _read_runs(name, source, dest, offset, outer, stride, lo * inner, run)
    finally:
        source.close()
    if log is not None:
        log.tensors[name] = (shard, out.nbytes)
        log.read_bytes += read_bytes
    return out


def _read_runs(name: str, source: _Bytes, dest: memoryview, offset: int, outer: int, stride: int,
               skip: int, run: int) -> int:
    """`outer` runs of `run` bytes, `skip` bytes into each `stride` from `offset`, into dest;
    -> the bytes read from the files."""
    if not run:
        return 0
    if run == stride:   # the runs touch: one read
        source.read_into(offset, dest, name)
        return len(dest)
    if outer == 1 or run >= DIRECT_RUN:
        for o in range(outer):
            source.read_into(offset + o * stride + skip, dest[o * run:(o + 1) * run], name)
        return len(dest)
    rows = max(1, BLOCK_BYTES // stride)
    block = np.empty(rows * stride, np.uint8)
    read_bytes = 0
    for first in range(0, outer, rows):
        count = min(rows, outer - first)
        source.read_into(offset + first * stride, memoryview(block)[:count * stride], name)
        chunk = block[:count * stride].reshape(count, stride)[:, skip:skip + run]
        dest[first * run:(first + count) * run] = np.ascontiguousarray(chunk).reshape(-1)
        read_bytes += count * stride
    return read_bytes


class Reader:
    """The loader's reads under a plan: each stored tensor's share of this rank (None where
    it holds none), logged; the single-process plan reads as dsv4 always did (memory maps)."""

    def __init__(self, plan):
        self.plan, self.log = plan, Log()

    def check(self, tensors) -> None:
        """Ask the plan for every (name, stored shape) first: a split that cuts a block is
        refused before the model is built and anything is read."""
        for name, shape in tensors:
            self.plan.tensor(name, tuple(shape))

    def tensor(self, info) -> Optional[np.ndarray]:
        """A safetensors TensorInfo's share."""
        if self.plan is SINGLE:
            return view(info)
        return read(info.name, [info.file], info.offset, info.storage, info.shape,
                    self.plan.tensor(info.name, info.shape), self.log)

    def reference(self, name: str, ref, base_dir: Path) -> Optional[np.ndarray]:
        """A tensor of config.json's dsv4.tensors (dsv4/tensor_refs.py), its share."""
        if self.plan is SINGLE:
            return tensor_refs.read(name, ref, base_dir)
        paths, offset, dtype, shape = tensor_refs.locate(name, ref, base_dir)
        return read(name, paths, offset, STORAGE[dtype], shape, self.plan.tensor(name, shape), self.log)
