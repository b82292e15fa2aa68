"""Engram store: rows read from files (interleaved and split layouts) and from memory.

The oracle is a numpy transcription of e4m3 * 2**(e8m0 - 127), rounded to bf16 (RNE) from the
exact value, and the raw bytes the test itself wrote to the file.
"""

import errno
import json
import os
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import engram_store as es
from dsv4 import flags
from dsv4 import safetensors_file as sf
from dsv4.pread_pool import native_reader
from tests.formats import e4m3_value

WIDTH = 256                       # values per row: the released model's engram_head_dim
ROW = es.Fp8Rows(WIDTH).row_bytes


@pytest.fixture(autouse=True, params=["python", "native"])
def reader(request):
    """Every test with the Python threads' reads and with the native reader's (the same rows and
    errors), but those that wrap os.preadv, which only the Python threads call."""
    native = request.param == "native"
    if native and request.node.get_closest_marker("python_reads"):
        pytest.skip("wraps os.preadv: the Python threads' reads only")
    if native and native_reader() is None:
        pytest.skip("the native reader cannot be built here")
    with flags.override(engram_native_reads=native):
        yield request.param


def open_table(ref, base_dir, name=None):
    return es.open_table(ref, base_dir, name, head_dim=WIDTH)


# --- oracle ---------------------------------------------------------------------------------

def bf16_bits(value: np.ndarray) -> np.ndarray:
    """Round exact float64 values (no double rounding: e4m3 needs 4 bits) to bf16 bits, RNE."""
    with np.errstate(over="ignore"):                 # beyond fp32 is inf, as in bf16
        bits = value.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def oracle_bits(raw: np.ndarray, width: int = WIDTH) -> np.ndarray:
    """Raw rows [..., width + width / 32] -> expected bf16 bits [..., width]."""
    scale = np.repeat(raw[..., width:].astype(np.int64), 32, axis=-1)
    return bf16_bits(e4m3_value(raw[..., :width]) * np.exp2((scale - 127).astype(np.float64)))


def bits(rows: mx.array) -> np.ndarray:
    return np.array(rows.view(mx.uint16))


# --- table files ----------------------------------------------------------------------------

def random_rows(rng: np.random.Generator, rows: int, width: int = WIDTH) -> np.ndarray:
    raw = rng.integers(0, 256, (rows, es.Fp8Rows(width).row_bytes), dtype=np.uint8)
    weight = raw[:, :width]
    weight[(weight & 0x7F) == 0x7F] ^= 1          # no NaN codes
    raw[:, width:] = rng.integers(100, 150, (rows, width // 32))
    return raw


def write_interleaved(path: Path, raw: np.ndarray, offset: int = 0) -> Path:
    with open(path, "wb") as f:
        f.write(b"\xAB" * offset)
        f.write(raw.tobytes())
        f.write(b"\xCD" * 100)                    # bytes after the table must not be read
    return path


def write_split(tmp: Path, raw: np.ndarray, name: str = "layers.1.engram") -> dict:
    """Weight and scale tensors in two safetensors shards, among other tensors; the reference."""
    sf.write(tmp / "shard-a.safetensors", {
        "a.before": ("F32", np.arange(7, dtype=np.float32)),
        f"{name}.embed.weight": ("F8_E4M3", np.ascontiguousarray(raw[:, :256])),
    })
    sf.write(tmp / "shard-b.safetensors", {
        f"{name}.embed.scale": ("F8_E8M0", np.ascontiguousarray(raw[:, 256:])),
        "z.after": ("U8", np.zeros(5, np.uint8)),
    })
    w = sf.read_header(tmp / "shard-a.safetensors")[0][f"{name}.embed.weight"]
    s = sf.read_header(tmp / "shard-b.safetensors")[0][f"{name}.embed.scale"]
    assert w.offset != s.offset
    return es.split_reference(w, s, tmp)


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def tables(tmp_path, rng):
    """(raw rows, {kind: table}) over one random table, in each layout."""
    raw = random_rows(rng, 3000)
    write_interleaved(tmp_path / "t.bin", raw, offset=777)
    interleaved = open_table({"layout": "interleaved264", "file": "t.bin", "offset": 777,
                                 "rows": len(raw)}, tmp_path, name="layers.1.engram")
    split = open_table(write_split(tmp_path, raw), tmp_path, name="layers.1.engram")
    resident = es.ResidentTable(raw, es.Fp8Rows(WIDTH), "layers.1.engram")
    yield raw, {"interleaved": interleaved, "split": split, "resident": resident}
    interleaved.close()
    split.close()


class CountingPread:
    """Wraps os.preadv: counts reads, and fails with EIO at chosen offsets."""

    def __init__(self, monkeypatch, fail_at=()):
        self.real = os.preadv
        self.fail_at = set(fail_at)
        self.calls = 0
        self.lock = threading.Lock()
        monkeypatch.setattr(os, "preadv", self)

    def __call__(self, fd, buffers, offset):
        with self.lock:
            self.calls += 1
        if offset in self.fail_at:
            raise OSError(errno.EIO, "Input/output error")
        return self.real(fd, buffers, offset)


# --- values ---------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [0, 1, 100, 120, 127, 140, 200, 254])
def test_every_e4m3_code_dequantizes_exactly(tmp_path, scale):
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]            # 254 finite codes, both zeros included
    raw = np.zeros((len(codes), ROW), np.uint8)
    raw[:, 0] = codes                                # each code in column 0 and ...
    raw[:, 255] = codes[::-1]                        # ... in the last column of the last group
    raw[:, 256:] = scale
    raw[:, 256 + 3] = 127                            # another group with scale 1
    raw[:, 3 * 32] = codes
    expected = oracle_bits(raw)
    table = es.InterleavedTable(write_interleaved(tmp_path / "codes.bin", raw), 0, len(raw), "codes")
    resident = es.ResidentTable(raw, es.Fp8Rows(WIDTH), "codes")
    ids = np.arange(len(raw))
    np.testing.assert_array_equal(bits(table.read(ids)), expected)
    np.testing.assert_array_equal(bits(resident.read(ids)), expected)
    got = bits(table.read(ids))
    assert got[codes.tolist().index(0x80), 0] == 0x8000   # signed zero kept
    assert got[codes.tolist().index(0x00), 0] == 0x0000
    table.close()


@pytest.mark.parametrize("kind", ["interleaved", "split", "resident"])
def test_rows_in_callers_order_with_duplicates(tables, kind):
    raw, by_kind = tables
    table = by_kind[kind]
    ids = np.array([[2999, 0, 5, 5], [17, 2999, 0, 1234]], dtype=np.int32)
    out = table.read(ids)
    assert out.shape == (2, 4, 256) and out.dtype == mx.bfloat16
    np.testing.assert_array_equal(bits(out), oracle_bits(raw[ids]))
    one = table.read(np.uint16(42))                  # a 0-d id gives one row [256]
    np.testing.assert_array_equal(bits(one), oracle_bits(raw[42]))
    assert table.read(np.zeros((0, 24), np.int64)).shape == (0, 24, 256)


@pytest.mark.parametrize("kind", ["interleaved", "split"])
def test_prefill_batch_read(tables, rng, kind):
    """A 512-token prompt: 12288 ids with many repeats, sorted, fanned out and scattered back."""
    raw, by_kind = tables
    ids = rng.integers(0, len(raw), (1, 512, 24))
    np.testing.assert_array_equal(bits(by_kind[kind].read(ids)), oracle_bits(raw[ids]))


@pytest.mark.parametrize("kind", ["interleaved", "split"])
def test_serial_equals_parallel_bit_for_bit(tables, rng, kind):
    raw, by_kind = tables
    table = by_kind[kind]
    sets = rng.integers(0, len(raw), (2000, 24))
    sets[::7, 3] = sets[::7, 9]                      # some duplicates inside a set
    with flags.override(engram_parallel_decode=False):
        serial = np.stack([table.read_raw(s) for s in sets])
    with flags.override(engram_parallel_decode=True, engram_decode_workers=4):
        parallel = np.stack([table.read_raw(s) for s in sets])
    np.testing.assert_array_equal(serial, raw[sets])
    np.testing.assert_array_equal(parallel, serial)
    with flags.override(engram_parallel_decode=True, engram_decode_workers=7):
        for s in sets[:50]:
            np.testing.assert_array_equal(bits(table.read(s)), oracle_bits(raw[s]))


@pytest.mark.python_reads
def test_row_cache_serves_repeats_without_reads(tables, monkeypatch, rng):
    raw, by_kind = tables
    table = by_kind["interleaved"]
    ids = rng.choice(len(raw), 24, replace=False)
    with flags.override(engram_row_cache=100):
        np.testing.assert_array_equal(table.read_raw(ids), raw[ids])
        counter = CountingPread(monkeypatch)
        np.testing.assert_array_equal(table.read_raw(ids[::-1]), raw[ids[::-1]])
        assert counter.calls == 0
        more = rng.choice(np.setdiff1d(np.arange(len(raw)), ids), 200, replace=False)
        np.testing.assert_array_equal(table.read_raw(more), raw[more])
        kept = np.sort(more)[-100:]                  # a call's misses enter in row order
        counter.calls = 0
        np.testing.assert_array_equal(table.read_raw(kept[::-1]), raw[kept[::-1]])
        assert counter.calls == 0
        evicted = np.concatenate([ids[:5], np.sort(more)[:5]])
        np.testing.assert_array_equal(table.read_raw(evicted), raw[evicted])
        assert counter.calls == 10


@pytest.mark.python_reads
@pytest.mark.parametrize("parallel", [False, True])
def test_start_returns_while_the_reads_run(tables, monkeypatch, parallel):
    raw, by_kind = tables
    gate = threading.Event()
    real = os.preadv

    def blocked(fd, buffers, offset):
        gate.wait(20)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", blocked)
    ids = np.arange(100, 124)
    with flags.override(engram_parallel_decode=parallel):
        started = time.perf_counter()
        requests = [by_kind[kind].start(ids) for kind in ("interleaved", "split")]
        assert time.perf_counter() - started < 10     # did not wait for the blocked reads
        gate.set()
        for request in requests:
            np.testing.assert_array_equal(bits(request.wait()), oracle_bits(raw[ids]))


@pytest.mark.python_reads
def test_reader_threads_are_persistent_and_reused(tables, monkeypatch, rng):
    raw, by_kind = tables
    readers = set()
    real = os.preadv

    def recording(fd, buffers, offset):
        readers.add(threading.current_thread().name)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", recording)
    with flags.override(engram_decode_workers=4, engram_prefill_workers=16):
        for _ in range(3):
            by_kind["interleaved"].read_raw(rng.integers(0, len(raw), 1000))   # grows the pool
        with flags.override(engram_parallel_decode=False):
            by_kind["interleaved"].read_raw(np.arange(24))                    # the serial reader
        threads = threading.active_count()
        for parallel in (True, False, True):
            with flags.override(engram_parallel_decode=parallel):
                for _ in range(100):
                    ids = rng.integers(0, len(raw), 24)
                    np.testing.assert_array_equal(by_kind["split"].read_raw(ids), raw[ids])
        assert threading.active_count() == threads
    assert all(name.startswith("pread") for name in readers)   # the shared pool (dsv4.pread_pool)
    assert len(readers) <= 16 + 1                  # the pool's threads and the serial reader


def test_native_reads_run_on_no_python_thread(tables, monkeypatch, rng, reader):
    """The native reader's reads: no os.preadv and no new Python thread, done while the caller
    keeps running Python; the rows the Python threads read."""
    if reader != "native":
        pytest.skip("the native reader's property")
    raw, by_kind = tables
    monkeypatch.setattr(os, "preadv", lambda *a: pytest.fail("a Python thread read"))
    threads = threading.active_count()
    with flags.override(engram_decode_workers=4):
        ids = rng.integers(0, len(raw), 24)
        request = by_kind["split"].start(ids)
        deadline = time.perf_counter() + 10
        while not request.done() and time.perf_counter() < deadline:
            pass                                     # Python, holding the GIL all along
        assert request.done()
        np.testing.assert_array_equal(bits(request.wait()), oracle_bits(raw[ids]))
        np.testing.assert_array_equal(by_kind["interleaved"].read_raw(np.arange(2000)), raw[:2000])
    assert threading.active_count() == threads


# --- bad input and bad data -----------------------------------------------------------------

@pytest.mark.parametrize("kind", ["interleaved", "split", "resident"])
@pytest.mark.parametrize("ids, expected", [
    (np.array([1.0, 2.0]), "integer"),
    (np.array([True, False]), "integer"),
    (np.array([0, -1, 3]), "row id -1"),
    (np.array([[0, 1], [3000, 2]]), "row id 3000"),
    (np.array([2**40]), "outside"),
    (["a"], "integer"),
])
@pytest.mark.python_reads
def test_invalid_ids_rejected_before_any_read(tables, monkeypatch, kind, ids, expected):
    _, by_kind = tables
    counter = CountingPread(monkeypatch)
    with pytest.raises(es.EngramError, match=expected) as info:
        by_kind[kind].start(ids)
    assert "layers.1.engram" in str(info.value)
    assert counter.calls == 0


@pytest.mark.parametrize("out", [
    np.full((2, 24, 264), 0x5A, np.int8),             # wrong dtype
    np.full((2, 24, 263), 0x5A, np.uint8),            # wrong row size
    np.full((48, 264), 0x5A, np.uint8),               # wrong shape
    np.full((2, 24, 264), 0x5A, np.uint8)[:, :, :],   # right: the control case
])
@pytest.mark.python_reads
def test_output_guards(tables, monkeypatch, out):
    raw, by_kind = tables
    table = by_kind["interleaved"]
    ids = np.arange(48).reshape(2, 24)
    poison = out.copy()
    counter = CountingPread(monkeypatch)
    if out.shape == (2, 24, 264) and out.dtype == np.uint8:
        assert table.read_raw(ids, out) is out
        np.testing.assert_array_equal(out, raw[ids])
        return
    with pytest.raises(es.EngramError, match=r"output must be uint8\[2, 24, 264\]"):
        table.read_raw(ids, out)
    np.testing.assert_array_equal(out, poison)
    assert counter.calls == 0
    readonly = np.zeros((2, 24, 264), np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(es.EngramError, match="read-only"):
        table.read_raw(ids, readonly)


@pytest.mark.python_reads
@pytest.mark.parametrize("workers, rows", [(4, 24), (16, 400)])
def test_error_in_each_partition_reaches_caller(tmp_path, monkeypatch, rng, workers, rows):
    raw = random_rows(rng, 1000)
    table = es.InterleavedTable(write_interleaved(tmp_path / "t.bin", raw, 64), 64, 1000, "layers.14.engram")
    ids = rng.choice(1000, rows, replace=False)
    ordered = np.sort(ids)
    bounds = [rows * k // workers for k in range(workers + 1)]
    out = np.full((rows, ROW), 0x5A, np.uint8)
    with flags.override(engram_decode_workers=workers, engram_prefill_workers=workers):
        for k in range(workers):
            bad = int(ordered[(bounds[k] + bounds[k + 1]) // 2])
            counter = CountingPread(monkeypatch, fail_at=[64 + ROW * bad])
            with pytest.raises(es.EngramReadError) as info:
                table.read_raw(ids, out)
            message = str(info.value)
            assert "layers.14.engram" in message and f"row {bad} " in message
            assert f"byte {64 + ROW * bad} of {tmp_path / 't.bin'}" in message
            assert info.value.errno == errno.EIO
            # every other partition ran to its end before the error was raised
            rest = bounds[k + 1] - (bounds[k] + bounds[k + 1]) // 2 - 1
            assert counter.calls == rows - rest
            np.testing.assert_array_equal(out, 0x5A)       # nothing half-written
            request = table.start(ids)
            for _ in range(2):                               # every wait raises it
                with pytest.raises(es.EngramReadError, match=f"row {bad} "):
                    request.wait()
            monkeypatch.undo()
    np.testing.assert_array_equal(table.read_raw(ids), raw[ids])
    CountingPread(monkeypatch, fail_at=[64 + ROW * 500])
    with pytest.raises(es.EngramReadError, match=r"layers.14.engram: reading rows \[500, 600\) "
                                                 rf"from byte {64 + ROW * 500} of .*t.bin failed"):
        table.read_range(500, 100)
    table.close()


@pytest.mark.parametrize("kind", ["interleaved", "split"])
def test_short_read_on_truncated_file_raises(tmp_path, rng, kind):
    raw = random_rows(rng, 100)
    if kind == "interleaved":
        path = write_interleaved(tmp_path / "t.bin", raw)
        table = es.InterleavedTable(path, 0, 100, "layers.1.engram")
        cut = 98 * ROW + 10                          # row 98 is cut short, row 99 is gone
    else:
        ref = write_split(tmp_path, raw)
        table = open_table(ref, tmp_path, name="layers.1.engram")
        path = tmp_path / "shard-b.safetensors"
        cut = ref["scale"]["offset"] + 98 * 8 + 3
    os.truncate(path, cut)
    np.testing.assert_array_equal(table.read_raw(np.arange(98)), raw[:98])
    for row in (98, 99):
        with pytest.raises(es.EngramReadError, match=f"short read of row {row} at byte .* of {path}"):
            table.read(np.array([0, row, 5]))
    with pytest.raises(es.EngramReadError, match="short read of row 98"):
        table.read_range(90, 10)
    table.close()
    with pytest.raises(es.EngramError, match=f"has {cut} bytes") as info:
        open_table(ref if kind == "split" else
                      {"layout": "interleaved264", "file": str(path), "offset": 0, "rows": 100},
                      tmp_path, name="layers.1.engram")
    assert str(path) in str(info.value) and "layers.1.engram" in str(info.value)


@pytest.mark.parametrize("where, code", [(0, 0x7F), (200, 0xFF), (256, 0xFF), (263, 0xFF)])
def test_nan_codes_rejected_naming_the_row(tmp_path, rng, where, code):
    raw = random_rows(rng, 50)
    raw[31, where] = code
    path = write_interleaved(tmp_path / "t.bin", raw, 8)
    table = es.InterleavedTable(path, 8, 50, "layers.1.engram")
    np.testing.assert_array_equal(table.read_raw(np.arange(31)), raw[:31])
    what = "e4m3 NaN code" if where < 256 else "e8m0 NaN code"
    with pytest.raises(es.EngramError, match=f"row 31 \\(byte {8 + 31 * ROW} of .*\\) holds the {what}"):
        table.read(np.array([3, 31]))
    with pytest.raises(es.EngramError, match="row 31 .* holds"):
        table.read_range(0, 50)
    with pytest.raises(es.EngramError, match=f"layers.1.engram: row 31 holds the {what}"):
        es.ResidentTable(raw, es.Fp8Rows(WIDTH), "layers.1.engram")
    dst = tmp_path / "copy.bin"
    with pytest.raises(es.EngramError, match="row 31"):
        es.copy_table(table, dst, progress=False)
    assert list(tmp_path.glob("copy.bin*")) == []     # nothing half-written
    table.close()


def test_rows_straddling_4gib_offsets(tmp_path, rng):
    """Sparse files: rows around byte 2**32 (interleaved) and a split table beyond it."""
    raw = random_rows(rng, 40)
    offset = 2**32 - 20 * ROW - 100                  # row 19 straddles byte 2**32
    path = tmp_path / "sparse.bin"
    with open(path, "wb") as f:
        f.seek(offset)
        f.write(raw.tobytes())
    assert os.stat(path).st_blocks * 512 < 2**20     # sparse: no real disk use
    table = es.InterleavedTable(path, offset, 40, "far")
    assert table.locate(19) == f"byte {offset + 19 * ROW} of {path}"
    ids = np.array([19, 20, 0, 39, 18, 19])
    np.testing.assert_array_equal(bits(table.read(ids)), oracle_bits(raw[ids]))
    np.testing.assert_array_equal(table.read_range(0, 40), raw)
    table.close()

    weight_at, scale_at = 2**32 + 5 * 2**30 + 3, 2**32 - 8 * 20 - 5
    with open(tmp_path / "w.bin", "wb") as f:
        f.seek(weight_at)
        f.write(raw[:, :256].tobytes())
    with open(tmp_path / "s.bin", "wb") as f:
        f.seek(scale_at)
        f.write(raw[:, 256:].tobytes())
    split = open_table({"layout": "split", "rows": 40,
                           "weight": {"file": "w.bin", "offset": weight_at},
                           "scale": {"file": "s.bin", "offset": scale_at}}, tmp_path, name="far")
    np.testing.assert_array_equal(split.read_raw(ids), raw[ids])
    np.testing.assert_array_equal(bits(split.read(ids)), oracle_bits(raw[ids]))
    split.close()


# --- references, copies, resident mode ------------------------------------------------------

def test_references_round_trip_through_json(tables, tmp_path):
    raw, by_kind = tables
    ref = write_split(tmp_path, raw)
    assert ref["weight"]["file"] == "shard-a.safetensors"  # relative to the model directory
    again = json.loads(json.dumps(ref))
    del again["weight"]["tensor"]                          # an offset alone is enough
    del again["scale"]["offset"]                           # so is a tensor name
    table = open_table(again, tmp_path, name="x")
    ids = np.array([5, 2999, 5])
    np.testing.assert_array_equal(table.read_raw(ids), raw[ids])
    table.close()
    ref = es.interleaved_reference(tmp_path / "t.bin", 777, len(raw), tmp_path)
    assert ref == {"layout": "interleaved264", "file": "t.bin", "offset": 777, "rows": len(raw)}
    assert es.interleaved_reference(tmp_path / "t.bin", 0, 1, "/elsewhere")["file"] == \
        str((tmp_path / "t.bin").resolve())
    with pytest.raises(es.EngramError, match=r"engram table in t.bin: 10 rows of 264 bytes"):
        open_table({"layout": "interleaved264", "file": "t.bin", "offset": 2**20, "rows": 10},
                      tmp_path)                     # no name given: errors name the file


@pytest.mark.parametrize("change, expected", [
    (lambda r: r.pop("rows"), "field 'rows' is missing"),
    (lambda r: r.update(rows="3000"), "field 'rows' must be int"),
    (lambda r: r.update(layout="rows264"), "layout 'rows264' is not one of"),
    (lambda r: r["weight"].update(offset=r["weight"]["offset"] + 1), "recorded offset .* starts at byte"),
    (lambda r: r["weight"].update(tensor="a.before"), r"a.before in .* is F32\[7\], expected F8_E4M3\[3000, 256\]"),
    (lambda r: r["scale"].update(tensor="nope"), "has no tensor nope"),
    (lambda r: (r["scale"].pop("tensor"), r["scale"].pop("offset")), "scale: needs 'offset' or 'tensor'"),
    (lambda r: r["scale"].update(file="missing.safetensors"), "missing.safetensors: file not found"),
    (lambda r: r.update(rows=2999), r"expected F8_E4M3\[2999, 256\]"),
])
def test_bad_references_name_the_field(tables, tmp_path, change, expected):
    raw, _ = tables
    ref = write_split(tmp_path, raw)
    change(ref)
    with pytest.raises(es.EngramError, match=f"layers.14.engram: engram table reference.*{expected}"):
        open_table(ref, tmp_path, name="layers.14.engram")


def test_copy_table_writes_a_self_contained_interleaved_file(tables, tmp_path, monkeypatch, capsys):
    raw, by_kind = tables
    monkeypatch.setattr(es, "CHUNK_ROWS", 1000)      # several chunks
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for kind in ("split", "resident"):
        ref = es.copy_table(by_kind[kind], model_dir / f"engram-{kind}.bin")
        assert ref == {"layout": "interleaved264", "file": f"engram-{kind}.bin", "offset": 0,
                       "rows": len(raw)}
        assert (model_dir / ref["file"]).read_bytes() == raw.tobytes()
        copy = open_table(ref, model_dir)
        np.testing.assert_array_equal(bits(copy.read(np.arange(0, 3000, 7))),
                                      oracle_bits(raw[::7]))
        copy.close()
    size = f"{raw.nbytes / 1e6:.1f} MB"   # the progress line counts bytes, not rows
    assert (f"copying layers.1.engram to {model_dir / 'engram-split.bin'}: {size} of {size} (100%)"
            in capsys.readouterr().err)
    assert sorted(p.name for p in model_dir.iterdir()) == ["engram-resident.bin", "engram-split.bin"]


def test_resident_mode_loads_tables_into_memory(tables, tmp_path, rng):
    raw, _ = tables
    ref = write_split(tmp_path, raw)
    with flags.override(engram_resident=True):
        with open_table(ref, tmp_path, name="layers.1.engram") as table:
            pass                                     # a context manager like the file tables
    assert isinstance(table, es.ResidentTable) and table.rows == len(raw)
    ids = rng.integers(0, len(raw), (3, 24))
    np.testing.assert_array_equal(bits(table.read(ids)), oracle_bits(raw[ids]))
    np.testing.assert_array_equal(table.read_range(10, 20), raw[10:30])


@pytest.mark.parametrize("hints", [False, True])
@pytest.mark.parametrize("readahead", [False, True])
def test_io_hints_do_not_change_rows(tmp_path, rng, hints, readahead):
    raw = random_rows(rng, 500)
    with flags.override(engram_io_hints=hints, engram_readahead=readahead):
        table = es.InterleavedTable(write_interleaved(tmp_path / "t.bin", raw), 0, 500, "t")
        for ids in (rng.integers(0, 500, 24), rng.integers(0, 500, 1000)):
            np.testing.assert_array_equal(table.read_raw(ids), raw[ids])
        split = open_table(write_split(tmp_path, raw), tmp_path, name="t")
        np.testing.assert_array_equal(split.read_raw(ids), raw[ids])
    table.close()
    split.close()


def test_tables_of_a_tiny_official_checkpoint(tmp_path, rng):
    """The references the official layout yields open as tables that return the stored rows."""
    from dsv4.config import ModelArgs
    from dsv4.layout import engram_table_refs
    from dsv4.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "ckpt", shards=3)
    ckpt = sf.Checkpoint(path)
    args = ModelArgs.from_dict(json.loads((path / "config.json").read_text()))
    refs = json.loads(json.dumps(engram_table_refs(ckpt, args)))
    assert sorted(refs) == sorted(str(layer) for layer in args.engram_layer_ids)
    for layer, ref in refs.items():
        table = open_table(ref, path, name=f"layers.{layer}.engram")
        weight = sf.view(ckpt[f"layers.{layer}.engram.embed.weight"])
        scale = sf.view(ckpt[f"layers.{layer}.engram.embed.scale"])
        assert table.rows == len(weight)
        ids = rng.integers(0, table.rows, (1, 5, 24))
        raw = np.concatenate([weight[ids], scale[ids]], axis=-1)
        np.testing.assert_array_equal(bits(table.read(ids)), oracle_bits(raw))
        table.close()


# --- row layouts from the config ----------------------------------------------------------------

def test_a_model_of_another_engram_width_reads_its_rows_from_the_config(tmp_path, rng):
    """engram_head_dim 64: rows of 64 e4m3 codes and 2 e8m0 scales, read exactly from the
    shards' bytes, and the model runs with them."""
    import dsv4
    from dsv4.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "ckpt", seed=2,
                                 config_overrides={"engram_head_dim": 64})
    model, tokenizer = dsv4.load(path)
    ckpt = sf.Checkpoint(path)
    for layer in model.args.engram_layer_ids:
        table = model._engram_tables[layer]
        weight = ckpt[f"layers.{layer}.engram.embed.weight"]
        scale = ckpt[f"layers.{layer}.engram.embed.scale"]
        assert weight.shape == (table.rows, 64) and scale.shape == (table.rows, 2)
        on_disk = np.concatenate([  # the bytes in the files, read without the store
            np.fromfile(weight.file, np.uint8, 64 * table.rows, offset=weight.offset).reshape(-1, 64),
            np.fromfile(scale.file, np.uint8, 2 * table.rows, offset=scale.offset).reshape(-1, 2),
        ], axis=1)
        ids = rng.integers(0, table.rows, (2, 3, 24))
        np.testing.assert_array_equal(bits(table.read(ids)), oracle_bits(on_disk[ids], 64))
    ids = np.array([tokenizer.encode("Flat is better than nested.")])
    logits = np.array(model(ids))
    assert logits.shape == (1, ids.shape[1], model.args.vocab_size) and np.isfinite(logits).all()


def test_a_reference_must_agree_with_the_configs_width(tables, tmp_path, rng):
    raw, _ = tables
    ref = {"layout": "interleaved264", "file": "t.bin", "offset": 777, "rows": len(raw)}
    with pytest.raises(es.EngramError, match="layout interleaved264 has rows of 264 bytes, but "
                                             r"engram_head_dim 64 makes them 66 \(64 e4m3 codes "
                                             r"and 2 e8m0 scales\)"):
        es.open_table(ref, tmp_path, "t", head_dim=64)
    with pytest.raises(es.EngramError, match=r"expected F8_E4M3\[3000, 64\]"):
        es.open_table(write_split(tmp_path, raw), tmp_path, "t", head_dim=64)
    with pytest.raises(es.EngramError, match="positive multiple of 32 values.*got engram_head_dim 48"):
        es.open_table(ref, tmp_path, "t", head_dim=48)
    narrow = random_rows(rng, 700, width=64)
    write_interleaved(tmp_path / "narrow.bin", narrow, offset=5)
    table = es.open_table({"layout": "interleaved66", "file": "narrow.bin", "offset": 5,
                           "rows": 700}, tmp_path, "t", head_dim=64)
    ids = rng.integers(0, 700, (3, 24))
    np.testing.assert_array_equal(bits(table.read(ids)), oracle_bits(narrow[ids], 64))
    assert es.copy_table(table, tmp_path / "copy.bin", progress=False) == {
        "layout": "interleaved66", "file": "copy.bin", "offset": 0, "rows": 700}
    assert (tmp_path / "copy.bin").read_bytes() == narrow.tobytes()
    table.close()


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_float_tables_of_a_dequantised_upload(tmp_path, rng, dtype):
    """BF16/F32 rows [rows, width] as stored (F32 rounded to bf16), in every table kind; a NaN
    or an infinity is refused naming the row."""
    values = rng.normal(0, 3, (500, 64)).astype(np.float32)
    stored = bf16_bits(values) if dtype == "BF16" else values
    want = bf16_bits(values)
    sf.write(tmp_path / "shard.safetensors", {"a.first": ("U8", np.zeros(3, np.uint8)),
                                              "layers.1.engram.embed.weight": (dtype, stored)})
    info = sf.read_header(tmp_path / "shard.safetensors")[0]["layers.1.engram.embed.weight"]
    ref = json.loads(json.dumps(es.float_reference(info, tmp_path)))
    assert ref == {"layout": dtype.lower(), "rows": 500, "weight": {
        "file": "shard.safetensors", "tensor": info.name, "offset": info.offset}}
    ids = rng.integers(0, 500, (4, 24))
    table = es.open_table(ref, tmp_path, "layers.1.engram", head_dim=64)
    np.testing.assert_array_equal(bits(table.read(ids)), want[ids])
    (tmp_path / "model").mkdir()
    copied = es.copy_table(table, tmp_path / "model" / "engram-01.bin", progress=False)
    assert copied == {"layout": dtype.lower(), "rows": 500,
                      "weight": {"file": "engram-01.bin", "offset": 0}}
    with flags.override(engram_resident=True):
        resident = es.open_table(copied, tmp_path / "model", "copy", head_dim=64)
    assert isinstance(resident, es.ResidentTable)
    np.testing.assert_array_equal(bits(resident.read(ids)), want[ids])
    table.close()
    with pytest.raises(es.EngramError, match=r"expected F32\[500, 32\]|expected BF16\[500, 32\]"):
        es.open_table(ref, tmp_path, "t", head_dim=32)
    for bad in (np.inf, np.nan):
        broken = stored.copy()
        broken[77, 5] = bf16_bits(np.float32(bad)) if dtype == "BF16" else bad
        path = tmp_path / f"broken-{bad}.bin"
        path.write_bytes(broken.tobytes())
        with es.FloatTable(path, 0, 500, "layers.1.engram", 64, dtype) as table:
            with pytest.raises(es.EngramError, match=f"row 77 .* holds the {dtype} value {bad} "
                                                     "at column 5"):
                table.read(np.array([3, 77]))


# --- a byte-split file (GGUF .part1/.part2) ------------------------------------------------------

def split_into_parts(path: Path, cuts: list[int]) -> list[Path]:
    """Cut a file into raw byte parts at `cuts` (as `split -b` does with a GGUF)."""
    data = path.read_bytes()
    bounds = [0, *cuts, len(data)]
    parts = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        part = path.with_name(f"{path.name}.part{k + 1}")
        part.write_bytes(data[a:b])
        parts.append(part)
    return parts


@pytest.mark.parametrize("parallel", [False, True])
def test_a_table_straddling_parts_reads_like_the_whole_file(tmp_path, rng, parallel):
    raw = random_rows(rng, 300)
    whole = write_interleaved(tmp_path / "t.gguf", raw, offset=4096)
    # One cut inside row 100 (not at a row boundary), one at the end of row 250.
    parts = split_into_parts(whole, [4096 + 100 * ROW + 77, 4096 + 251 * ROW])
    ref = es.interleaved_reference(parts, 4096, 300)
    table = open_table(json.loads(json.dumps(ref)), tmp_path, "parted")
    ids = np.concatenate([[99, 100, 101, 250, 251, 0, 299], rng.integers(0, 300, 200)])
    with flags.override(engram_parallel_decode=parallel):
        np.testing.assert_array_equal(bits(table.read(ids)), oracle_bits(raw[ids]))
    np.testing.assert_array_equal(table.read_range(95, 160), raw[95:255])


def test_a_truncated_last_part_is_a_short_read_naming_the_part(tmp_path, rng):
    raw = random_rows(rng, 50)
    whole = write_interleaved(tmp_path / "t.gguf", raw)
    parts = split_into_parts(whole, [20 * ROW + 5])
    with pytest.raises(es.EngramError, match="end at byte"):
        open_table(es.interleaved_reference(parts[:1], 0, 50), tmp_path, "cut")
    table = open_table(es.interleaved_reference(parts, 0, 50), tmp_path, "cut")
    os.truncate(parts[1], parts[1].stat().st_size - 110)  # the 100 padding bytes and 10 of row 49
    with pytest.raises(es.EngramReadError, match=r"short read of row 49 at byte \d+ of .*part2"):
        table.read(np.array([49]))
