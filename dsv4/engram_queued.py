"""Engram rows read inside the step's graph (DSV4_ENGRAM_QUEUED), so that a decoder queues a whole
step before its token is known.

Read on the host, a step's rows need its token there first: the decoder waits for the step
before, hashes, reads, and only then encodes the layers after the first Engram layer, while the
device idles (dsv4/step_pieces.py narrows that gap). Here the rows are nodes of the graph:

    row ids    NgramHasher.row_ids on the step's tokens as MLX arrays (the same int64 hash)
    raw rows   EngramRows (dsv4/native/engram_rows.cpp): pread on a CPU stream of its own once
               the ids are ready, on a few C++ threads (no Python, so no GIL), with the
               engram_readahead hints, the NaN checks of the host path, and a status
    rows       the table's RowFormat.decode on the device, as the host path decodes them

so the step's graph holds everything, the device waits for the reads instead of the host, and
the rows are bit-identical to the host path's (tests/test_engram_queued.py).

A failed read (an I/O error, a truncated file, a NaN code) does not stop the graph: its status
says which row, and `QueuedRows.check()` raises the error the host path raises for that row
(naming the table, the row and the file). The decoder checks each step's reads two steps later,
when they are long done, and all of them when it rewinds or closes.

It needs the native extension (dsv4/native: a C++ compiler and nanobind); without it, or for a
table held in memory (engram_resident) or with engram_row_cache, the decoder reads on the host.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
import mlx.core as mx
import numpy as np

from . import flags, native
from .engram_store import EngramReadError, FileTable, Fp8Rows

_CHECKS = {"fp8": 0, "BF16": 1, "F32": 2}   # the NaN checks of engram_rows.cpp
_state: dict = {}                             # the native module, or why it is unavailable


def _module():
    if "module" not in _state:
        try:
            _state["module"] = native.load("engram_rows")
        except native.Unavailable as e:
            _state["module"] = None
            print(f"dsv4: Engram rows are read on the host (DSV4_ENGRAM_QUEUED needs the native "
                  f"reader): {e}", file=sys.stderr)
    return _state["module"]


def _stream() -> mx.Stream:
    """The reads' CPU stream: its own thread, so nothing else on the CPU stream delays them."""
    if "stream" not in _state:
        _state["stream"] = mx.new_stream(mx.cpu)
    return _state["stream"]


def applies(model) -> bool:
    """Whether this model's decode steps read their Engram rows in the graph."""
    from .model import Model
    if not (flags.get("engram_queued") and isinstance(model, Model) and model.args.engram_layer_ids):
        return False
    tables = getattr(model, "_engram_tables", {})
    if not tables or int(flags.get("engram_row_cache")) > 0:
        return False
    if not all(isinstance(t, FileTable) for t in tables.values()):
        return False
    return _module() is not None


def _segments(table: FileTable) -> list[list[int]]:
    """engram_rows.cpp's segments: [offset, stride, width, dest, (fd, start, size) per part]."""
    out = []
    for seg in table._segments:
        parts = [v for (_, fd, size), start in zip(seg.file.parts, seg.file.starts) for v in (fd, start, size)]
        out.append([seg.offset, seg.stride, seg.width, seg.dest, *parts])
    return out


def _check(table: FileTable) -> tuple[int, int]:
    fmt = table.row_format
    return (_CHECKS["fp8"] if isinstance(fmt, Fp8Rows) else _CHECKS[fmt.dtype]), fmt.width


def read(table: FileTable, ids: mx.array) -> tuple[mx.array, mx.array]:
    """The rows ids [n] (MLX, maybe unevaluated) of a file table, bf16 [n, width], and the
    reads' status [3] int64 (engram_rows.cpp), both lazy nodes of the graph."""
    parallel = flags.get("engram_parallel_decode")
    workers = int(flags.get("engram_decode_workers")) if parallel else 1
    check, width = _check(table)
    raw, status = _module().engram_rows(ids, _segments(table), table.row_format.row_bytes, check, width,
                                        workers, bool(flags.get("engram_readahead")), _stream())
    return table.row_format.decode(raw, (ids.shape[0],)), status


class QueuedRows(Mapping):
    """A step's Engram rows by layer ("layer" -> [B, S, heads, dim] bf16), lazy: the new tokens
    [B, S] (MLX, maybe unevaluated) after `past` [B, >= 0] (the last at position offset - 1)."""

    def __init__(self, model, tokens: mx.array, past: mx.array, offset: int):
        ids = model._hasher.row_ids(tokens, past, offset)
        self.rows: dict[str, mx.array] = {}
        self.reads: list[tuple[FileTable, mx.array, mx.array]] = []   # (table, ids, status)
        for layer, table in model._engram_tables.items():
            flat = ids[layer].reshape(-1)
            rows, status = read(table, flat)
            self.rows[str(layer)] = rows.reshape(*ids[layer].shape[:2], -1, model.args.engram_head_dim)
            self.reads.append((table, flat, status))
        # Each stream's part queued on its own: across evaluations a stream waits for another's
        # event on the device (or the CPU stream's thread), while within one MLX waits on the
        # host (CUDA's fences), which would hold the step's encoding until the token is known.
        mx.async_eval([flat for _, flat, _ in self.reads])
        mx.async_eval([status for _, _, status in self.reads])   # the reads (raw rows: siblings)

    def __getitem__(self, layer: str) -> mx.array:
        return self.rows[layer]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def check(self) -> None:
        """Raise the host path's error for the first row that failed (waits for the reads)."""
        for table, ids, status in self.reads:
            what, index, error = status.tolist()
            if what:
                row = int(np.array(ids)[index])
                table.read_raw(np.array([row]))   # raises what the host path raises for it
                raise EngramReadError(error or None, f"{table.name}: reading row {row} at "
                                      f"{table.locate(row)} failed: {os.strerror(error) if error else 'short read'}")


class Checks:
    """A decoder's queued reads not yet checked: each step's are checked two steps later."""

    def __init__(self):
        self.unchecked: list[QueuedRows] = []

    def add(self, reads: QueuedRows) -> None:
        while len(self.unchecked) > 1:
            self.unchecked.pop(0).check()
        self.unchecked.append(reads)

    def all(self) -> None:
        while self.unchecked:
            self.unchecked.pop(0).check()
