"""Engram rows read inside the step's graph (dsv4/engram_queued.py, dsv4/native/reads.cpp).

Oracles: the bytes the test wrote to the table files, and the host path (FileTable.read, itself
checked against a numpy transcription of the fp8 decode in test_engram_store.py) for the rows;
the decoder with its rows read on the host (DSV4_ENGRAM_QUEUED off, checked against the reference
path in test_step.py and test_step_pieces.py) for every logit, draft input and buffer, which must
be bit-identical since the same rows meet the same graph. Errors must be the host path's.
"""

import os
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4 import engram_queued, flags, native, pread_pool, step, step_pieces
from dsv4 import engram_store as es
from dsv4.kernels.dialect import backend
from tests.test_engram_store import ROW, WIDTH, random_rows, write_interleaved, write_split
from tests.test_step_pieces import batch_outputs

FP32 = dict(kv_qdq=False, act_quant=False)


@pytest.fixture(scope="module", autouse=True)
def reader():
    try:
        return native.load("reads")
    except native.Unavailable as e:
        pytest.skip(f"the native Engram reader cannot be built here: {e}")


@pytest.fixture(scope="module")
def model(draft_dir):
    with flags.override(draft="on"):
        return dsv4.load(draft_dir, dtype=mx.float32)[0]


@pytest.fixture
def queued_decoding(reader):
    """The decoder-level tests: not on CUDA without the reader's CUDA part (the decoder reads on
    the host then)."""
    if backend() == "cuda" and not reader.gpu_reads:
        pytest.skip(engram_queued.NO_CUDA_READS)


def float_table(tmp_path, rng, dtype):
    values = rng.standard_normal((500, 64)).astype(np.float32)
    stored = values if dtype == "F32" else (values.view(np.uint32) >> 16).astype(np.uint16)
    path = write_interleaved(tmp_path / f"{dtype}.bin", stored.view(np.uint8).reshape(500, -1), 96)
    return es.FileTable(f"layers.3.engram ({dtype})", 500, [(path, 96, stored[0].nbytes, 0)],
                        es.FloatRows(64, dtype))


@pytest.mark.parametrize("kind", ["interleaved", "split", "parts", "BF16", "F32"])
@pytest.mark.parametrize("workers", [1, 3])
def test_rows_equal_the_host_reads(tmp_path, kind, workers):
    """Every layout: the rows, in the ids' order with repeats, bit for bit the host path's; ids
    computed in the graph; a status of (0, 0, 0)."""
    rng = np.random.default_rng(7)
    raw = random_rows(rng, 700)
    if kind == "interleaved":
        table = es.InterleavedTable(write_interleaved(tmp_path / "t.bin", raw, 777), 777, 700, "layers.1.engram")
    elif kind == "split":
        table = es.open_table(write_split(tmp_path, raw), tmp_path, "layers.1.engram", head_dim=WIDTH)
    elif kind == "parts":   # a byte-split file, cut inside rows: reads cross the parts
        whole = write_interleaved(tmp_path / "whole.bin", raw, 40).read_bytes()
        cuts = [0, 40 + 3 * ROW + 17, 40 + 300 * ROW + 1, len(whole)]
        parts = []
        for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
            parts.append(tmp_path / f"part{k}")
            parts[-1].write_bytes(whole[a:b])
        table = es.InterleavedTable(parts, 40, 700, "layers.1.engram")
    else:
        table = float_table(tmp_path, rng, kind)
    ids = np.concatenate([rng.integers(0, table.rows, 60), [3, 3, 299, 300, 0, table.rows - 1]])
    with flags.override(engram_decode_workers=workers):
        rows, status = engram_queued.read(table, (mx.array(ids) * 5 - mx.array(ids) * 4).astype(mx.uint32))
        want = table.read(ids)
        assert rows.dtype == mx.bfloat16 and rows.shape == want.shape
        assert np.array_equal(np.array(rows.view(mx.uint16)), np.array(want.view(mx.uint16)))
        assert status.tolist() == [0, 0, 0]
    table.close()


def test_rows_can_be_read_in_a_compiled_function(tmp_path):
    rng = np.random.default_rng(2)
    raw = random_rows(rng, 300)
    table = es.InterleavedTable(write_interleaved(tmp_path / "t.bin", raw), 0, 300, "layers.1.engram")
    summed = mx.compile(lambda ids: engram_queued.read(table, ids % 300)[0].astype(mx.float32).sum(axis=-1))
    ids = rng.integers(0, 10_000, 40)
    assert mx.array_equal(summed(mx.array(ids)), table.read(ids % 300).astype(mx.float32).sum(axis=-1)).item()
    table.close()


def run(model, prompt, schedule, queued: bool, batch: int = 1):
    """Every output of the schedule's steps: (n, taken back) feeds with the draft inputs, n = 0
    a one-token decode step; then the buffers after the last and the tokens closed into the cache."""
    rng = np.random.default_rng(5)
    out = []
    with flags.override(compile=True, engram_queued=queued, **FP32):
        cache = model.make_cache(reserve=8)
        model(np.repeat(prompt, batch, axis=0), cache)
        dec = step.FixedDecoder(model, cache)
        for n, back in schedule:
            if n == 0:
                out.append(dec(mx.array(rng.integers(7, 500, batch))))
                continue
            logits, hidden = dec.feed(mx.array(rng.integers(7, 500, (batch, n))), hidden=True)
            out += [logits, *hidden]
            dec.rewind(back)
        mx.eval(out, dec.buffers)
        buffers = dict(dec.buffers)
        dec.close(dec.pos)
        return out, buffers, cache.tokens


@pytest.mark.parametrize("batch", [1, 2])
def test_decoder_with_queued_reads_equals_host_reads(model, queued_decoding, monkeypatch, batch):
    """Decode steps and verifies of 1..6 positions with rewinds, across ring wraps and buffer
    doublings: every logit, draft input and buffer row bit-identical to the host reads', the
    same tokens in the cache; and every step's rows were read in the graph, none on the host."""
    monkeypatch.setattr(step, "MIN_CAPACITY", 4)
    rng = np.random.default_rng(3)
    schedule = [(0, 0)] * 4 + [(int(n), int(rng.integers(0, n))) for n in rng.integers(1, 7, 10)] + [(0, 0)] * 12
    prompt = np.random.default_rng(0).integers(7, 500, (1, 5))
    host = run(model, prompt, schedule, queued=False, batch=batch)
    made, original = [], engram_queued.QueuedRows
    monkeypatch.setattr(engram_queued, "QueuedRows", lambda *a: made.append(1) or original(*a))
    monkeypatch.setattr(step_pieces, "PendingRows", lambda *a: pytest.fail("a decode step read on the host"))
    queued = run(model, prompt, schedule, queued=True, batch=batch)
    assert len(made) == len(schedule)
    assert len(queued[0]) == len(host[0]) > len(schedule)
    for got, want in zip(queued[0], host[0]):
        assert got.shape == want.shape and mx.array_equal(got, want).item()
    assert queued[1].keys() == host[1].keys()
    for name in host[1]:
        assert mx.array_equal(queued[1][name], host[1][name]).item(), name
    assert np.array_equal(queued[2], host[2])


def test_the_batch_with_queued_reads_equals_host_reads(model, queued_decoding, monkeypatch):
    """The server's batch (dsv4/batch_step.py) of sessions at different positions: the same."""
    monkeypatch.setattr(step, "MIN_CAPACITY", 4)
    got, want = batch_outputs(model, engram_queued=True)[0], batch_outputs(model, engram_queued=False)[0]
    assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))


def test_switching_between_queued_and_host_reads_mid_decode(model, queued_decoding, monkeypatch):
    """The switch read per step: steps alternating between the two paths hash the same history."""
    monkeypatch.setattr(step, "MIN_CAPACITY", 4)
    prompt = np.random.default_rng(0).integers(7, 500, (1, 6))
    tokens = np.random.default_rng(4).integers(7, 500, 9)

    def run(pattern):
        with flags.override(compile=True, **FP32):
            cache = model.make_cache(reserve=8)
            model(prompt, cache)
            dec = step.FixedDecoder(model, cache)
            out = []
            for token, queued in zip(tokens, pattern):
                with flags.override(engram_queued=queued):
                    out.append(dec(mx.array([int(token)])))
            mx.eval(out)
            return out

    mixed, host = run([True, True, False, True, False, False, True, True, False]), run([False] * 9)
    assert all(mx.array_equal(g, w).item() for g, w in zip(mixed, host))


def damaged_model(model, tmp_path, damage):
    """The model with its first Engram table replaced by a copy that `damage(raw, path)` spoils;
    the table's raw rows."""
    layer, table = next(iter(model._engram_tables.items()))
    raw = table.read_range(0, table.rows)
    path = write_interleaved(tmp_path / "damaged.bin", raw)
    copy = es.InterleavedTable(path, 0, table.rows, table.name, width=table.row_format.width)
    damage(raw, path)
    return layer, table, copy


@pytest.mark.parametrize("damage", ["nan", "truncated"])
def test_a_bad_row_raises_the_host_paths_error(model, queued_decoding, monkeypatch, tmp_path, damage):
    """A NaN code in, or a file cut short before, every row: the decoder raises what the host
    path raises for the row, naming the table, the row and the file, by the time it closes."""
    def spoil(raw, path):
        if damage == "nan":
            raw[:, 5] = 0x7F
            write_interleaved(path, raw)
        else:
            os.truncate(path, 10)

    layer, table, copy = damaged_model(model, tmp_path, spoil)
    monkeypatch.setitem(model._engram_tables, layer, copy)
    expected = (es.EngramError, "holds the e4m3 NaN code 0x7F at column 5") if damage == "nan" else \
        (es.EngramReadError, "short read of row")
    with flags.override(compile=True, engram_queued=True, **FP32):
        cache = model.make_cache(reserve=8)
        monkeypatch.setitem(model._engram_tables, layer, table)   # the prompt reads good rows
        model(np.array([[11, 12, 13]]), cache)
        monkeypatch.setitem(model._engram_tables, layer, copy)
        dec = step.FixedDecoder(model, cache)
        with pytest.raises(expected[0], match=expected[1]) as info:
            for token in (20, 21, 22, 23):
                mx.eval(dec(mx.array([token])))
            dec.close(dec.pos)
    assert table.name in str(info.value) and str(tmp_path / "damaged.bin") in str(info.value)
    copy.close()


def test_without_a_compiler_the_rows_are_read_on_the_host(model, monkeypatch, capsys):
    """No native reader: one line says why, and the decoder reads on the host."""
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(pread_pool, "_native", {})
    with flags.override(engram_queued=True):
        assert not engram_queued.applies(model)
        assert not engram_queued.applies(model)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "read by Python threads" in err and "/nonexistent/c++" in err


@pytest.mark.parametrize("gpu_reads", [False, True])
def test_on_cuda_only_with_the_readers_cuda_part(model, monkeypatch, capsys, gpu_reads):
    """On CUDA the queued reads need the reader's CUDA part; without it the host reads run (the
    reason said once). On the CPU a CPU stream reads, either way."""
    monkeypatch.setattr(engram_queued, "_state", {})
    monkeypatch.setattr(engram_queued, "native_reader", lambda: SimpleNamespace(gpu_reads=gpu_reads))
    with flags.override(engram_queued=True):
        monkeypatch.setattr(engram_queued, "backend", lambda: "cuda")
        assert engram_queued.applies(model) == gpu_reads and engram_queued.applies(model) == gpu_reads
        monkeypatch.setattr(engram_queued, "backend", lambda: None)
        assert engram_queued.applies(model)
        assert engram_queued._stream().device == mx.cpu
    err = capsys.readouterr().err
    assert err.count("\n") == (0 if gpu_reads else 1) and (gpu_reads or engram_queued.NO_CUDA_READS in err)
