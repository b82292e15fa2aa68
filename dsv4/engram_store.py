"""Engram tables: rows of engram_head_dim values, read where they lie on disk.

Each of the model's two Engram tables has ~384 M rows (~95 GiB); every token reads 24 rows of
each (model-spec 6). A row of the released model is 256 fp8 e4m3 codes and 8 e8m0 scales; the
width comes from the config (`engram_head_dim`: that many codes and one scale per 32), and a
dequantised upload may store the rows as BF16 or F32 instead (`Fp8Rows`, `FloatRows`: the
bytes of a row and their decoding). A table hands rows out as bf16: exactly
`e4m3 * 2**(e8m0 - 127)` per group of 32 values (MLX `mxfp8`), or the float values as stored
(F32 rounded to bf16, as the reference's lookup returns them):

    request = table.start(ids)    # validates ids, starts the reads, returns at once
    rows = request.wait()         # [*ids.shape, width] bfloat16; raises a worker's error

Kinds of table:
- `InterleavedTable`: fp8 rows with their scales behind them (264 bytes at width 256) from a
  64-bit offset of a file: the ds4 GGUF layout and the layout `copy_table` writes. One `pread`
  per row.
- `SplitTable`: the official safetensors layout, a weight tensor [rows, width] F8_E4M3 and a
  scale tensor [rows, width / 32] F8_E8M0, possibly in different shard files. Two `pread`s per
  row.
- `FloatTable`: a BF16 or F32 tensor [rows, width] (a dequantised upload), or `copy_table`'s
  copy of one.
- `ResidentTable`: the raw rows in memory, decoded as the file tables decode them.

Reads run on the native reader's C++ threads (dsv4/native/reads.cpp, `engram_native_reads`:
no GIL until the rows are waited for), else on the persistent Python pread pool of
dsv4/pread_pool.py; the streamed experts (dsv4/expert_store.py) share both. A call is sorted by
row and de-duplicated, then split into contiguous partitions, one per worker; each worker writes only
its own slice of the call's buffer, and its error stays with its own future. `wait()` joins
every worker before it raises the first error (in partition order) or returns. A call of at
most `BATCH_ROWS` distinct rows (a decode step) uses `engram_decode_workers` workers, or, when
`engram_parallel_decode` is off, the pool's one serial reader thread (one
pread per row, one after another); a larger call (prefill) uses `engram_prefill_workers`.
With `engram_readahead` a worker first hands all its rows to the kernel (posix_fadvise
WILLNEED), so their disk reads are in flight together before its preads wait for them.
Errors name the table, the row and the file offset. A short read is an error, never zeros.
NaN codes (e4m3 0x7F/0xFF, e8m0 0xFF; float NaN and infinities) are rejected with the row that
holds them.

Table reference (JSON), as a dsv4 model directory's config.json records it for each Engram
layer under `config["dsv4"]["engram"]["<layer id>"]`; a relative "file" is relative to the
model directory:

    {"layout": "interleaved264", "file": "engram-01.bin", "offset": 0, "rows": 384006168}
    {"layout": "interleaved264", "parts": ["/q4.gguf.part1", "/q4.gguf.part2"],
     "offset": 98765432, "rows": 384016682}     # a byte-split file: the offset runs over all parts

    {"layout": "split", "rows": 384006168,
     "weight": {"file": "/ckpt/model-00003-of-00048.safetensors",
                "tensor": "layers.1.engram.embed.weight", "offset": 123456},
     "scale":  {"file": "/ckpt/model-00005-of-00048.safetensors",
                "tensor": "layers.1.engram.embed.scale", "offset": 789}}

    {"layout": "bf16", "rows": 384006168,       # or "f32": a dequantised upload's tensor
     "weight": {"file": "/ckpt/model-00003-of-00048.safetensors",
                "tensor": "layers.1.engram.embed.weight", "offset": 123456}}

An interleaved layout is named by its row's bytes, `interleaved<width + width / 32>`
(interleaved264 at width 256, the ds4 GGUF's); the width itself is the config's
engram_head_dim, which `open_table` takes and checks the reference against. In a split or
float entry "tensor" and "offset" may each be left out (not both): the tensor is found with
`safetensors_file.read_header`, its dtype and shape are checked, and a recorded offset must
agree with it. `interleaved_reference`, `split_reference` and `float_reference` build these
dicts; `open_table` turns one into a table (a `ResidentTable` when `engram_resident` is on);
`copy_table` writes a self-contained file of the table's raw rows and returns its reference.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from dsv4 import flags
from dsv4.atomic_file import atomic_file
from dsv4.errors import InputError
from dsv4.progress import Progress
from dsv4.pread_pool import NativeRead, OpenFiles, PartedFile, Reads, executor, native_reader
from dsv4.safetensors_file import CheckpointError, TensorInfo, read_header
from dsv4.tensor_refs import recorded_path

GROUP = 32           # e4m3 codes per e8m0 scale
RELEASED_WIDTH = 256  # engram_head_dim of DeepSeek V4.1 Flash: the ds4 GGUF's 264-byte rows
FLOAT_STORAGE = {"BF16": np.dtype(np.uint16), "F32": np.dtype(np.float32)}
LAYOUTS = ("interleaved<row bytes>", "split", "bf16", "f32")
# Decode steps read 24 rows per table per token; calls above this many distinct rows are
# batch reads (prefill) and fan out over engram_prefill_workers.
BATCH_ROWS = 64
# Rows per bulk read when copying or loading a whole table (~17 MB).
CHUNK_ROWS = 1 << 16


class EngramError(InputError):
    """Bad ids, a bad table reference, or a table that holds what it must not."""


class EngramReadError(OSError):
    """A row could not be read (I/O error, short read on a truncated file)."""


# --- shared helpers --------------------------------------------------------------------------

def _validate_ids(ids, rows: int, name: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """ids as flat int64 and their shape; every id an integer in [0, rows)."""
    array = np.asarray(ids)
    if array.dtype.kind not in "iu":
        raise EngramError(f"{name}: row ids must be an integer array, got dtype {array.dtype}")
    flat = array.reshape(-1)
    if flat.size:
        bad = np.flatnonzero((flat < 0) | (flat >= rows))
        if bad.size:
            i = int(bad[0])
            raise EngramError(
                f"{name}: row id {flat[i]} (position {np.unravel_index(i, array.shape)}) is "
                f"outside the table's {rows} rows [0, {rows})")
    return flat.astype(np.int64), array.shape


@dataclass(frozen=True)
class Fp8Rows:
    """A row of `width` fp8 e4m3 codes followed by its width / 32 e8m0 scales."""
    width: int = RELEASED_WIDTH

    def __post_init__(self):
        if self.width <= 0 or self.width % GROUP:
            raise EngramError(f"an fp8 Engram row needs a positive multiple of {GROUP} values "
                              f"(one e8m0 scale per {GROUP}), got engram_head_dim {self.width}")

    @property
    def row_bytes(self) -> int:
        return self.width + self.width // GROUP

    @property
    def layout(self) -> str:
        """The name of the interleaved layout of these rows."""
        return f"interleaved{self.row_bytes}"

    def decode(self, raw, shape: tuple[int, ...]) -> mx.array:
        """Raw rows [n, row_bytes] uint8 (numpy, or MLX: decoded in the graph) -> bf16
        [*shape, width], exactly e4m3 * 2**(e8m0 - 127)."""
        if raw.shape[0] == 0:
            return mx.zeros((*shape, self.width), dtype=mx.bfloat16)
        if isinstance(raw, mx.array):
            weight = mx.contiguous(raw[:, :self.width]).view(mx.uint32)
            scales = mx.contiguous(raw[:, self.width:])
        else:
            weight = mx.array(np.ascontiguousarray(raw[:, :self.width]).view(np.uint32))
            scales = mx.array(np.ascontiguousarray(raw[:, self.width:]))
        out = mx.dequantize(weight, scales, group_size=GROUP, bits=8, mode="mxfp8",
                            dtype=mx.bfloat16)
        return out.reshape(*shape, self.width)

    def first_nan(self, raw: np.ndarray) -> Optional[tuple[int, str]]:
        """(index of the first row holding a NaN code, what it holds), or None."""
        weight_nan = (raw[:, :self.width] & 0x7F) == 0x7F
        scale_nan = raw[:, self.width:] == 0xFF
        bad = np.flatnonzero(weight_nan.any(axis=1) | scale_nan.any(axis=1))
        if not bad.size:
            return None
        i = int(bad[0])
        if weight_nan[i].any():
            j = int(np.argmax(weight_nan[i]))
            return i, f"the e4m3 NaN code 0x{raw[i, j]:02X} at column {j}"
        j = int(np.argmax(scale_nan[i]))
        return i, f"the e8m0 NaN code 0xFF as scale {j}"


@dataclass(frozen=True)
class FloatRows:
    """A row of `width` BF16 or F32 values (little-endian), as a dequantised upload stores its
    tables. Handed out as bf16, as the reference's lookup returns rows (F32 rounded, RNE)."""
    width: int
    dtype: str = "BF16"

    def __post_init__(self):
        if self.width <= 0:
            raise EngramError(f"an Engram row needs a positive width, got {self.width}")
        if self.dtype not in FLOAT_STORAGE:
            raise EngramError(f"float Engram rows are {' or '.join(FLOAT_STORAGE)}, "
                              f"not {self.dtype}")

    @property
    def layout(self) -> str:
        return self.dtype.lower()

    @property
    def row_bytes(self) -> int:
        return self.width * FLOAT_STORAGE[self.dtype].itemsize

    def _values(self, raw: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(raw).view(FLOAT_STORAGE[self.dtype]).reshape(-1, self.width)

    def decode(self, raw, shape: tuple[int, ...]) -> mx.array:
        """Raw rows [n, row_bytes] uint8 (numpy, or MLX: decoded in the graph) -> bf16 [*shape, width]."""
        if isinstance(raw, mx.array):
            values = raw.view(mx.uint16 if self.dtype == "BF16" else mx.float32)
        else:
            values = mx.array(self._values(raw))
        values = values.view(mx.bfloat16) if self.dtype == "BF16" else values.astype(mx.bfloat16)
        return values.reshape(*shape, self.width)

    def first_nan(self, raw: np.ndarray) -> Optional[tuple[int, str]]:
        """(index of the first row holding a NaN or an infinity, what it holds), or None."""
        values = self._values(raw)
        if self.dtype == "BF16":
            bad = (values & 0x7F80) == 0x7F80  # exponent all ones
        else:
            bad = ~np.isfinite(values)
        rows = np.flatnonzero(bad.any(axis=1))
        if not rows.size:
            return None
        i = int(rows[0])
        j = int(np.argmax(bad[i]))
        value = float(values[i, j]) if self.dtype == "F32" else \
            float((values[i, j:j + 1].astype(np.uint32) << 16).view(np.float32)[0])
        return i, f"the {self.dtype} value {value} at column {j}"


RowFormat = Union[Fp8Rows, FloatRows]


def dequantize_rows(raw: np.ndarray, shape: Optional[tuple[int, ...]] = None) -> mx.array:
    """Raw interleaved fp8 rows [n, width + width / 32] uint8 -> bf16 [*shape, width]."""
    rows = Fp8Rows(raw.shape[1] * GROUP // (GROUP + 1))
    return rows.decode(raw, (raw.shape[0],) if shape is None else tuple(shape))


class _RowCache:
    """Least-recently-used raw rows of one table, bounded by a row count."""

    def __init__(self):
        self._rows: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def fill(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy the cached rows into `out`; the mask of rows found."""
        hit = np.zeros(len(rows), bool)
        with self._lock:
            for i, row in enumerate(rows.tolist()):
                data = self._rows.get(row)
                if data is not None:
                    self._rows.move_to_end(row)
                    out[i] = np.frombuffer(data, np.uint8)
                    hit[i] = True
        return hit

    def put(self, rows: np.ndarray, raw: np.ndarray, capacity: int) -> None:
        with self._lock:
            for row, data in zip(rows.tolist(), raw):
                self._rows[row] = data.tobytes()
                self._rows.move_to_end(row)
            while len(self._rows) > capacity:
                self._rows.popitem(last=False)


# --- file-backed tables ----------------------------------------------------------------------

@dataclass(frozen=True)
class _Segment:
    """`width` bytes of each row at `offset + stride * row` of a file, stored at `dest` in the row."""
    file: PartedFile
    offset: int
    stride: int
    width: int
    dest: int

    def at(self, row: int) -> int:
        return self.offset + self.stride * row

    @property
    def path(self) -> Path:
        return self.file.path


class FileTable:
    """A table over regions of existing files, read with pread on the shared pool."""

    def __init__(self, name: str, rows: int, regions: Sequence[tuple], row_format: RowFormat):
        """regions: (file, offset of row 0, bytes per row in the file, position in the row),
        together the `row_format.row_bytes` of a row; `file` is a path or a list of a split
        file's parts (offsets then run over them all)."""
        self.name = name
        self.rows = int(rows)
        self.row_format = row_format
        if self.rows <= 0:
            raise EngramError(f"{name}: a table needs at least one row, got {rows}")
        self._files = OpenFiles(bool(flags.get("engram_io_hints")))
        segments = []
        try:
            for paths, offset, width, dest in regions:
                paths = [Path(p) for p in (paths if isinstance(paths, (list, tuple)) else [paths])]
                for path in paths:
                    if not path.is_file():
                        raise EngramError(f"{name}: table file {path} not found")
                file = self._files.file(paths)
                end = offset + width * self.rows
                if offset < 0 or end > file.size:
                    raise EngramError(
                        f"{name}: {self.rows} rows of {width} bytes from byte {offset} end at byte "
                        f"{end}, but {file.path} has {file.size} bytes")
                segments.append(_Segment(file, offset, width, width, dest))
        except BaseException:
            self._files.close()
            raise
        self._segments = tuple(segments)
        self._cache = _RowCache()

    def close(self) -> None:
        self._files.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, rows={self.rows}, files={self.files()})"

    def files(self) -> list[str]:
        return sorted({str(p) for s in self._segments for p, _, _ in s.file.parts})

    def locate(self, row: int) -> str:
        """Where a row lies, for error messages."""
        return " and ".join(s.file.where(s.at(row)) for s in self._segments)

    def native_layout(self) -> tuple:
        """(segments, row bytes, NaN check, width) as dsv4/native/reads.cpp takes a table:
        a segment is [offset, stride, width, position in the row, (fd, start, size) per part]."""
        segments = [[seg.offset, seg.stride, seg.width, seg.dest, *seg.file.native_parts()] for seg in self._segments]
        fmt = self.row_format
        check = 0 if isinstance(fmt, Fp8Rows) else {"BF16": 1, "F32": 2}[fmt.dtype]
        return segments, fmt.row_bytes, check, fmt.width

    def failure(self, row: int, error: int) -> Exception:
        """The error of the Python reads for `row`, which the native reader found bad (errno
        `error`, or 0): the row read again here, so that the message names what is wrong."""
        try:
            self._read_partition(np.array([row]), np.empty((1, self.row_format.row_bytes), np.uint8), False)
        except (EngramError, EngramReadError) as e:
            return e
        message = f"{self.name}: reading row {row} at {self.locate(row)} failed"
        return EngramReadError(error, f"{message}: {os.strerror(error)}") if error else EngramReadError(message)

    # -- reading --------------------------------------------------------------------------------

    def start(self, ids: np.ndarray) -> Reads:
        flat, shape = _validate_ids(ids, self.rows, self.name)
        futures, raw = self._dispatch(flat)
        return Reads(futures, lambda: self.row_format.decode(raw(), shape))

    def read(self, ids) -> mx.array:
        return self.start(ids).wait()

    def read_raw(self, ids, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The raw rows [*ids.shape, row bytes] uint8, written into `out` when given (checked
        first)."""
        flat, shape = _validate_ids(ids, self.rows, self.name)
        row_bytes = self.row_format.row_bytes
        _check_out(out, (*shape, row_bytes), self.name)
        futures, raw = self._dispatch(flat)
        rows = Reads(futures, raw).wait().reshape(*shape, row_bytes)
        if out is None:
            return rows
        out[...] = rows
        return out

    def read_range(self, first: int, count: int) -> np.ndarray:
        """Rows first..first+count-1 as [count, row bytes] uint8, one bulk read per region."""
        if first < 0 or count < 0 or first + count > self.rows:
            raise EngramError(f"{self.name}: rows [{first}, {first + count}) are outside [0, {self.rows})")
        out = np.empty((count, self.row_format.row_bytes), np.uint8)
        for seg in self._segments:
            part = out if seg.width == out.shape[1] else np.empty((count, seg.width), np.uint8)
            try:
                got = seg.file.pread(memoryview(part).cast("B"), seg.at(first))
            except OSError as e:
                raise EngramReadError(
                    e.errno, f"{self.name}: reading rows [{first}, {first + count}) from "
                             f"{seg.file.where(seg.at(first))} failed: {e.strerror or e}") from e
            if got < part.nbytes:
                row = first + got // seg.width
                raise EngramReadError(
                    f"{self.name}: short read of row {row} at {seg.file.where(seg.at(first) + got)}: "
                    f"the file ends there (truncated?)")
            if part is not out:
                out[:, seg.dest:seg.dest + seg.width] = part
        self._check_codes(np.arange(first, first + count), out)
        return out

    def _dispatch(self, flat: np.ndarray):
        """Start reading the rows `flat`; (futures, a function giving the rows in `flat`'s order)."""
        unique, inverse = np.unique(flat, return_inverse=True)  # sorted rows = sorted offsets
        row_bytes = self.row_format.row_bytes
        buf = np.empty((len(unique), row_bytes), np.uint8)
        capacity = int(flags.get("engram_row_cache"))
        missing = None
        if capacity > 0:
            missing = np.flatnonzero(~self._cache.fill(unique, buf))
        todo = unique if missing is None else unique[missing]
        target = buf if missing is None else np.empty((len(todo), row_bytes), np.uint8)

        if len(unique) > BATCH_ROWS:
            workers = int(flags.get("engram_prefill_workers"))
        elif flags.get("engram_parallel_decode"):
            workers = int(flags.get("engram_decode_workers"))
        else:
            workers = 1
        reader = native_reader() if flags.get("engram_native_reads") and len(todo) else None
        if reader is not None:   # C++ threads: no GIL to wait for while the caller runs Python
            todo = np.ascontiguousarray(todo, dtype=np.int64)
            read = reader.start_rows(todo, target, *self.native_layout(), workers, bool(flags.get("engram_readahead")))
            futures = [NativeRead(read, lambda i, error: self.failure(int(todo[i]), error))]
        else:
            parts = max(1, min(workers, len(todo)))
            pool = executor(1 if parts == 1 else max(int(flags.get("engram_prefill_workers")),
                                                      2 * int(flags.get("engram_decode_workers")), parts))
            readahead = bool(flags.get("engram_readahead")) and hasattr(os, "posix_fadvise")
            bounds = [len(todo) * k // parts for k in range(parts + 1)]
            futures = [pool.submit(self._read_partition, todo[a:b], target[a:b], readahead)
                       for a, b in zip(bounds, bounds[1:]) if b > a]

        def rows_in_call_order() -> np.ndarray:
            if missing is not None and len(todo):
                buf[missing] = target
                self._cache.put(todo, target, capacity)
            return buf[inverse]

        return futures, rows_in_call_order

    def _read_partition(self, rows: np.ndarray, out: np.ndarray, readahead: bool) -> None:
        """Read `rows` into `out` [len(rows), row bytes]; runs on a worker and writes nothing
        else."""
        view = memoryview(out).cast("B")
        row_list = rows.tolist()
        row_bytes = out.shape[1]
        if readahead:  # the kernel starts every page read now; the preads below then wait less
            for row in row_list:
                for seg in self._segments:
                    seg.file.will_need(seg.at(row), seg.width)
        for i, row in enumerate(row_list):
            base = i * row_bytes
            for seg in self._segments:
                offset = seg.at(row)
                try:
                    got = seg.file.pread(view[base + seg.dest:base + seg.dest + seg.width], offset)
                except OSError as e:
                    raise EngramReadError(
                        e.errno, f"{self.name}: reading row {row} at {seg.file.where(offset)} "
                                 f"failed: {e.strerror or e}") from e
                if got < seg.width:
                    raise EngramReadError(
                        f"{self.name}: short read of row {row} at {seg.file.where(offset)}: "
                        f"got {got} of {seg.width} bytes (file truncated?)")
        self._check_codes(rows, out)

    def _check_codes(self, rows: np.ndarray, raw: np.ndarray) -> None:
        found = self.row_format.first_nan(raw)
        if found is not None:
            i, what = found
            row = int(rows[i])
            raise EngramError(f"{self.name}: row {row} ({self.locate(row)}) holds {what}; "
                              f"Engram rows must be finite")


def _check_out(out: Optional[np.ndarray], shape: tuple[int, ...], name: str) -> None:
    if out is None:
        return
    if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or tuple(out.shape) != shape:
        got = f"{out.dtype}{list(out.shape)}" if isinstance(out, np.ndarray) else type(out).__name__
        raise EngramError(f"{name}: output must be uint8{list(shape)}, got {got}")
    if not out.flags.writeable:
        raise EngramError(f"{name}: output array is read-only")


class InterleavedTable(FileTable):
    """fp8 rows, each `width` e4m3 codes then its scales (264 bytes at width 256), from byte
    `offset` of `path`."""

    def __init__(self, path: Union[Path, str, Sequence[Union[Path, str]]], offset: int, rows: int,
                 name: str, width: int = RELEASED_WIDTH):
        """`path` is one file, or the parts of a byte-split file in order (offset into all)."""
        row_format = Fp8Rows(width)
        super().__init__(name, rows, [(path, int(offset), row_format.row_bytes, 0)], row_format)


class SplitTable(FileTable):
    """Weight rows [rows, width] and scale rows [rows, width / 32] at their own offsets, maybe in
    two files."""

    def __init__(self, weight_path: Path | str, weight_offset: int,
                 scale_path: Path | str, scale_offset: int, rows: int, name: str,
                 width: int = RELEASED_WIDTH):
        row_format = Fp8Rows(width)
        super().__init__(name, rows, [(Path(weight_path), int(weight_offset), width, 0),
                                      (Path(scale_path), int(scale_offset), width // GROUP, width)],
                         row_format)


class FloatTable(FileTable):
    """BF16 or F32 rows [rows, width] from byte `offset` of `path` (a tensor of a dequantised
    upload, or a copy of one)."""

    def __init__(self, path: Path | str, offset: int, rows: int, name: str, width: int,
                 dtype: str = "BF16"):
        row_format = FloatRows(width, dtype)
        super().__init__(name, rows, [(Path(path), int(offset), row_format.row_bytes, 0)],
                         row_format)


# --- resident table --------------------------------------------------------------------------

class ResidentTable:
    """A table's raw rows [rows, row bytes] uint8 in memory, decoded as the file tables do."""

    def __init__(self, raw: np.ndarray, row_format: RowFormat, name: str):
        self.name = name
        self.row_format = row_format
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != row_format.row_bytes:
            raise EngramError(f"{name}: a resident table needs rows uint8[rows, "
                              f"{row_format.row_bytes}], got {raw.dtype}{list(raw.shape)}")
        self.rows = raw.shape[0]
        if self.rows == 0:
            raise EngramError(f"{name}: a table needs at least one row")
        for first in range(0, self.rows, CHUNK_ROWS):
            found = row_format.first_nan(raw[first:first + CHUNK_ROWS])
            if found is not None:
                raise EngramError(f"{name}: row {first + found[0]} holds {found[1]}; "
                                  f"Engram rows must be finite")
        self._raw = raw

    def __repr__(self) -> str:
        return f"ResidentTable({self.name!r}, rows={self.rows})"

    def start(self, ids: np.ndarray) -> Reads:
        flat, shape = _validate_ids(ids, self.rows, self.name)
        rows = self.row_format.decode(self._raw[flat], shape)
        return Reads([], lambda: rows)

    def read(self, ids) -> mx.array:
        return self.start(ids).wait()

    def read_range(self, first: int, count: int) -> np.ndarray:
        if first < 0 or count < 0 or first + count > self.rows:
            raise EngramError(f"{self.name}: rows [{first}, {first + count}) are outside [0, {self.rows})")
        return self._raw[first:first + count].copy()

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


Table = Union[InterleavedTable, SplitTable, FloatTable, ResidentTable]


def load_resident(table: Table, progress: bool = True) -> ResidentTable:
    """Read a whole table into memory."""
    row_bytes = table.row_format.row_bytes
    raw = np.empty((table.rows, row_bytes), np.uint8)
    shown = Progress(f"loading {table.name}", table.rows * row_bytes, progress)
    for first in range(0, table.rows, CHUNK_ROWS):
        count = min(CHUNK_ROWS, table.rows - first)
        raw[first:first + count] = table.read_range(first, count)
        shown.advance(count * row_bytes)
    shown.finish()
    return ResidentTable(raw, table.row_format, table.name)


# --- references ------------------------------------------------------------------------------

def interleaved_reference(file: Union[Path, str, Sequence[Union[Path, str]]], offset: int, rows: int,
                          base_dir: Optional[Path | str] = None, width: int = RELEASED_WIDTH) -> dict:
    """`file` is one file, or the parts of a byte-split file in order ("parts" in the reference)."""
    where = ({"parts": [recorded_path(p, base_dir) for p in file]}
             if isinstance(file, (list, tuple)) else {"file": recorded_path(file, base_dir)})
    return {"layout": Fp8Rows(width).layout, **where, "offset": int(offset), "rows": int(rows)}


def _tensor_entry(tensor: TensorInfo, base_dir: Optional[Path | str]) -> dict:
    return {"file": recorded_path(tensor.file, base_dir), "tensor": tensor.name,
            "offset": tensor.offset}


def split_reference(weight: TensorInfo, scale: TensorInfo,
                    base_dir: Optional[Path | str] = None) -> dict:
    """The reference of an official-layout table (weight [rows, width] F8_E4M3, scale
    [rows, width / 32] F8_E8M0)."""
    return {"layout": "split", "rows": int(weight.shape[0]),
            "weight": _tensor_entry(weight, base_dir), "scale": _tensor_entry(scale, base_dir)}


def float_reference(weight: TensorInfo, base_dir: Optional[Path | str] = None) -> dict:
    """The reference of a dequantised upload's table (a BF16 or F32 tensor [rows, width])."""
    return {"layout": weight.dtype.lower(), "rows": int(weight.shape[0]),
            "weight": _tensor_entry(weight, base_dir)}


def copy_reference(row_format: RowFormat, file: Path | str, rows: int,
                   base_dir: Optional[Path | str] = None) -> dict:
    """The reference of a file of raw rows from its first byte, as `copy_table` writes one."""
    if isinstance(row_format, FloatRows):
        return {"layout": row_format.layout, "rows": int(rows),
                "weight": {"file": recorded_path(file, base_dir), "offset": 0}}
    return interleaved_reference(file, 0, rows, base_dir, row_format.width)


def stored_rows(ref: dict, head_dim: int, where: str = "engram table reference") -> RowFormat:
    """How the rows of the table `ref` describes are stored, `head_dim` (the config's
    engram_head_dim) values a row; a reference that disagrees with it is an EngramError."""
    layout = _field(ref, "layout", str, where)
    if layout.upper() in FLOAT_STORAGE:
        return FloatRows(head_dim, layout.upper())
    fp8 = Fp8Rows(head_dim)
    if layout in ("split", fp8.layout):
        return fp8
    other = re.fullmatch(r"interleaved(\d+)", layout)
    if other:
        raise EngramError(f"{where}: layout {layout} has rows of {other[1]} bytes, but "
                          f"engram_head_dim {head_dim} makes them {fp8.row_bytes} ({head_dim} "
                          f"e4m3 codes and {head_dim // GROUP} e8m0 scales)")
    raise EngramError(f"{where}: layout {layout!r} is not one of {list(LAYOUTS)}")


def _field(ref: dict, key: str, kind, where: str):
    if not isinstance(ref, dict) or key not in ref:
        raise EngramError(f"{where}: field {key!r} is missing")
    value = ref[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise EngramError(f"{where}: field {key!r} must be {kind.__name__}, got {value!r}")
    if kind is int and value < 0:
        raise EngramError(f"{where}: field {key!r} must not be negative, got {value}")
    return value


def _split_region(entry: dict, part: str, dtype: str, width: int, rows: int,
                  base_dir: Path, where: str) -> tuple[Path, int]:
    where = f"{where} {part}"
    path = base_dir / _field(entry, "file", str, where)
    offset = entry.get("offset")
    if offset is not None:
        offset = _field(entry, "offset", int, where)
    if "tensor" in entry:
        tensor = _field(entry, "tensor", str, where)
        try:
            info = read_header(path)[0].get(tensor)
        except CheckpointError as e:
            raise EngramError(f"{where}: {e}") from None
        if info is None:
            raise EngramError(f"{where}: {path} has no tensor {tensor}")
        if info.dtype != dtype or info.shape != (rows, width):
            raise EngramError(f"{where}: tensor {tensor} in {path} is {info.dtype}{list(info.shape)}, "
                              f"expected {dtype}{[rows, width]}")
        if offset is not None and offset != info.offset:
            raise EngramError(f"{where}: recorded offset {offset} but tensor {tensor} starts at "
                              f"byte {info.offset} of {path}")
        offset = info.offset
    elif offset is None:
        raise EngramError(f"{where}: needs 'offset' or 'tensor'")
    return path, offset


def open_table(ref: dict, base_dir: Path | str, name: Optional[str] = None, *,
               head_dim: int) -> Table:
    """The table a reference describes, rows of `head_dim` values (the config's
    engram_head_dim); a relative file is found under `base_dir`. `name` (e.g.
    "layers.1.engram") is what errors call the table; by default its file's name."""
    base_dir = Path(base_dir)
    if not isinstance(ref, dict):
        raise EngramError(f"{name or 'engram table'}: its reference must be a JSON object, "
                          f"got {type(ref).__name__}")
    if name is None:
        file = ref.get("file") or (ref.get("parts") or [None])[0] or (ref.get("weight") or {}).get("file", "?")
        name = f"engram table in {Path(str(file)).name}"
    where = f"{name}: engram table reference"
    rows_as = stored_rows(ref, head_dim, where)
    rows = _field(ref, "rows", int, where)
    if isinstance(rows_as, FloatRows):
        weight = _split_region(_field(ref, "weight", dict, where), "weight", rows_as.dtype,
                               head_dim, rows, base_dir, where)
        table: Table = FloatTable(*weight, rows, name, head_dim, rows_as.dtype)
    elif ref["layout"] == "split":
        weight = _split_region(_field(ref, "weight", dict, where), "weight", "F8_E4M3",
                               head_dim, rows, base_dir, where)
        scale = _split_region(_field(ref, "scale", dict, where), "scale", "F8_E8M0",
                              head_dim // GROUP, rows, base_dir, where)
        table = SplitTable(*weight, *scale, rows, name, head_dim)
    else:
        if "parts" in ref:
            parts = _field(ref, "parts", list, where)
            if not parts or not all(isinstance(p, str) for p in parts):
                raise EngramError(f"{where}: field 'parts' must be a non-empty list of file names")
            path = [base_dir / p for p in parts]
        else:
            path = base_dir / _field(ref, "file", str, where)
        table = InterleavedTable(path, _field(ref, "offset", int, where), rows, name, head_dim)
    if flags.get("engram_resident"):
        with table:
            return load_resident(table)
    return table


def copy_table(table: Table, dst_file: Path | str, base_dir: Optional[Path | str] = None,
               progress: bool = True) -> dict:
    """Write `table`'s raw rows as a self-contained file (fp8 rows interleaved with their
    scales, float rows as they are); its reference (file relative to `base_dir`, by default the
    file's directory). Written under a temporary name and renamed at the end, so a failed copy
    leaves nothing behind."""
    dst_file = Path(dst_file)
    row_bytes = table.row_format.row_bytes
    shown = Progress(f"copying {table.name} to {dst_file}", table.rows * row_bytes, progress)
    with atomic_file(dst_file) as f:
        for first in range(0, table.rows, CHUNK_ROWS):
            count = min(CHUNK_ROWS, table.rows - first)
            f.write(table.read_range(first, count).data)
            shown.advance(count * row_bytes)
    shown.finish()
    return copy_reference(table.row_format, dst_file, table.rows,
                          dst_file.parent if base_dir is None else base_dir)
