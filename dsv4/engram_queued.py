"""Engram rows read inside the step's graph (DSV4_ENGRAM_QUEUED), so that a decoder queues a whole
step before its token is known.

Read on the host, a step's rows need its token there first: the decoder waits for the step
before, hashes, reads, and only then encodes the layers after the first Engram layer, while the
device idles (dsv4/step_pieces.py narrows that gap). Here the rows are nodes of the graph:

    row ids    NgramHasher.row_ids on the step's tokens as MLX arrays (the same int64 hash)
    raw rows   EngramRows (dsv4/native/reads.cpp): pread once the ids are ready, on a few
               C++ threads (no Python, so no GIL), with the engram_readahead hints, the NaN
               checks of the host path, and a status; on a CPU stream of its own, or on CUDA
               as a host function in the step's own stream (reads_cuda.h)
    rows       the table's RowFormat.decode on the device, as the host path decodes them

so the step's graph holds everything, the device waits for the reads instead of the host, and
the rows are bit-identical to the host path's (tests/test_engram_queued.py).

A failed read (an I/O error, a truncated file, a NaN code) does not stop the graph: its status
says which row, and `QueuedRows.check()` raises the error the host path raises for that row
(naming the table, the row and the file). The decoder checks each step's reads two steps later,
when they are long done, and all of them when it rewinds or closes.

Each stream's part is queued by its own mx.async_eval: within one evaluation MLX waits for a
cross-stream input on the host, which would stop the step's encoding at the reads.

Not a CPU stream on CUDA: each of its events allocates and frees managed memory there, which
synchronizes the device while the device waits for the reads, and the H100 slice hung
(benchmarks/results/2026-12-05-1740-engram-queued-cuda.md). There the reads are a host function
in the step's stream instead, which needs CUDA's headers at the native build (dsv4/native).
Metal's events allocate nothing per event: the CPU stream, unmeasured there.

It needs the native extension (dsv4/native: a C++ compiler and nanobind); without it (on CUDA:
without its CUDA part), and for a table held in memory (engram_resident) or with
engram_row_cache, the decoder reads on the host.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import mlx.core as mx
import numpy as np

from . import encode_thread, flags
from .engram_store import FileTable
from .pread_pool import native_reader
from .kernels.dialect import backend

# Why not on CUDA without the CUDA part (a CPU stream hung the H100 slice:
# benchmarks/results/2026-12-05-1740-engram-queued-cuda.md).
NO_CUDA_READS = ("the native reader has no CUDA part (its build needs cuda.h, cuda_runtime.h and "
                 "crt/host_config.h: pip install nvidia-cuda-runtime nvidia-cuda-crt, or set "
                 "CUDA_HOME), and a CPU stream's reads would stall the device on CUDA")
_state: dict = {}   # the reads' CPU stream, the reasons said


def _declined(why: str) -> bool:
    """Say once per process why the rows are read on the host; False."""
    if why not in _state.setdefault("said", set()):
        _state["said"].add(why)
        print(f"dsv4: Engram rows are read on the host (DSV4_ENGRAM_QUEUED): {why}", file=sys.stderr)
    return False


def reads_stream_of_their_own() -> bool:
    """Whether the reads run on a CPU stream of their own (not on CUDA: see `_stream`)."""
    return backend() != "cuda"


def _stream() -> mx.Stream:
    """Where the reads run: on CUDA the step's own stream (the reads a host function in it), else
    a CPU stream with its own thread, so nothing else on the CPU stream delays them."""
    if not reads_stream_of_their_own():
        return mx.default_stream(mx.gpu)
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
    reader = native_reader()
    if reader is not None and backend() == "cuda" and not reader.gpu_reads:
        return _declined(NO_CUDA_READS)
    return reader is not None


def read(table: FileTable, ids: mx.array) -> tuple[mx.array, mx.array]:
    """The rows ids [n] (MLX, maybe unevaluated) of a file table, bf16 [n, width], and the
    reads' status [3] int64 (reads.cpp), both lazy nodes of the graph."""
    parallel = flags.get("engram_parallel_decode")
    workers = int(flags.get("engram_decode_workers")) if parallel else 1
    raw, status = native_reader().engram_rows(ids, *table.native_layout(), workers,
                                              bool(flags.get("engram_readahead")), _stream())
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
        # Each stream's part queued on its own (see the module's notes).
        encode_thread.async_eval([flat for _, flat, _ in self.reads])
        encode_thread.async_eval([status for _, _, status in self.reads])   # the reads (raw rows: siblings)

    def __getitem__(self, layer: str) -> mx.array:
        return self.rows[layer]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def check(self) -> None:
        """Raise the host path's error for the first row that failed (waits for the reads)."""
        for table, ids, status in self.reads:
            encode_thread.evaluate(status, ids)
            what, index, error = status.tolist()
            if what:
                raise table.failure(int(np.array(ids)[index]), error)


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
