"""The batched fixed-shape step (dsv4/batch_step.py) against dsv4.batch_decode, which gives, bit
for bit, each session alone (tests/test_batch_decode.py).

Oracle: decode_sessions over reference caches, teacher-forced on the same tokens. In float32
without the official roundings the two differ only by the order of fp32 sums (top-k rows in
another order, padded to other widths), so logits agree to ~1e-6 relative and greedy tokens are
identical; with the roundings a value on an fp8/fp4 boundary may flip (bound 1e-3, as
test_step.py). Sessions sit at different positions (before any compressed row, inside and past
the window, across candidate blocks), small rings wrap and small buffers double; after close()
each cache continues as the reference's does.
"""

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4 import flags, step
from dsv4.batch_decode import decode_sessions
from dsv4.batch_step import REGIMES, SessionsDecoder, batch_regimes
from dsv4.generation import prefill

FP32 = dict(kv_qdq=False, act_quant=False)
LENGTHS = [1, 9, 30]


@pytest.fixture(scope="module")
def model(tiny_dir):
    return dsv4.load(tiny_dir, dtype=mx.float32)[0]


def relative(a, b):
    return float(mx.max(mx.abs(a - b)) / mx.max(mx.abs(b)))


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(7, 500, n).tolist() for n in LENGTHS]


def prefilled(model, prompt):
    cache = model.make_cache(reserve=4)
    return cache, int(mx.argmax(prefill(model, np.array([prompt]), cache)[0]))


def test_regimes_take_the_most_general():
    sessions = [((2, "none"), (5, "all")), ((2, "score"), (5, "all")), ((2, "all"), (5, "score+candidates"))]
    assert batch_regimes(sessions) == ((2, "score"), (5, "score+candidates"))
    assert REGIMES[0] == "none" and REGIMES[-1] == "score+candidates"


@pytest.mark.parametrize("qdq", [False, True])
def test_batched_fixed_steps_equal_the_reference_batch(model, monkeypatch, qdq):
    monkeypatch.setattr(step, "MIN_CAPACITY", 4)
    steps = 24
    with flags.override(kv_qdq=qdq, act_quant=qdq, compile=False):
        # The reference batch decodes greedily; its tokens are fed to both (teacher forcing).
        ref = [prefilled(model, p) for p in prompts()]
        fed = [[first] for _, first in ref]
        want = []
        for _ in range(steps):
            logits = decode_sessions(model, [c for c, _ in ref], [t[-1] for t in fed])
            want.append(logits)
            for t, pick in zip(fed, np.argmax(np.array(logits), -1)):
                t.append(int(pick))
        mine = [prefilled(model, p) for p in prompts()]
        dec = SessionsDecoder(model, [c for c, _ in mine])
        got = [dec(mx.array([t[n] for t in fed])) for n in range(steps)]
        assert dec.sessions[-1].buffers["2.compressed"].shape[1] > 4   # the buffers grew
        dec.close(dec.positions)
    errs = [relative(g, w) for g, w in zip(got, want)]
    assert max(errs) < (1e-3 if qdq else 1e-5), max(errs)
    assert np.array_equal(np.argmax(np.array(mx.stack(got)), -1), np.argmax(np.array(mx.stack(want)), -1))
    # The caches handed back hold the same tokens and continue as the reference's.
    nxt = np.array([[11, 12, 13]])
    with flags.override(kv_qdq=qdq, act_quant=qdq):
        for (cache, _), (theirs, _) in zip(mine, ref):
            assert np.array_equal(cache.tokens, theirs.tokens)
            assert relative(model(nxt, cache), model(nxt, theirs)) < (1e-3 if qdq else 1e-5)


def test_compiled_batch_equals_uncompiled(model):
    runs = []
    tokens = np.random.default_rng(1).integers(7, 500, (12, len(LENGTHS)))
    with flags.override(**FP32):
        for compiled in (False, True):
            with flags.override(compile=compiled):
                model.__dict__.pop("_fixed_batch_steps", None)
                dec = SessionsDecoder(model, [prefilled(model, p)[0] for p in prompts()])
                regimes, out = set(), []
                for t in tokens:
                    regimes.add(batch_regimes([d.variant()[1] for d in dec.sessions]))
                    out.append(dec(mx.array(t)))
                runs.append(mx.stack(out))
                dec.close(dec.positions)
    assert relative(runs[1], runs[0]) < 1e-5
    # One graph per way of selecting: where each session is inside its groups is not traced.
    assert len(model.__dict__["_fixed_batch_steps"]) == len(regimes) < len(tokens)


def test_the_engine_keeps_a_batch_until_it_changes(model):
    """The server's engine (DSV4_BATCH_FIXED_DECODE on): sessions join and leave the batch
    (its decoder is closed and made again), a finished session's cache is settled for the prefix
    cache; logits follow the reference batch's throughout."""
    from dsv4.serve.engine import ModelEngine

    engine = ModelEngine(model, None)
    with flags.override(batch_fixed_decode=True, compile=False, **FP32):
        ref = [prefilled(model, p) for p in prompts()]
        mine = [prefilled(model, p) for p in prompts()]
        fed = [[first] for _, first in ref]
        for n, members in enumerate([[0, 1], [0, 1], [0, 1, 2], [0, 1, 2], [1, 2], [1, 2], [1, 2]]):
            want = decode_sessions(model, [ref[i][0] for i in members], [fed[i][-1] for i in members])
            got = engine.decode([mine[i][0] for i in members], [fed[i][-1] for i in members])
            assert relative(got, want) < 1e-5, n
            assert isinstance(engine._batch[1], SessionsDecoder)
            for i, pick in zip(members, np.argmax(np.array(want), -1)):
                fed[i].append(int(pick))
            if n == 3:   # session 0 ends: the scheduler settles its cache
                engine.settle(mine[0][0])
                assert engine._batch is None and mine[0][0].offset == ref[0][0].offset
        engine.settle()
    for (cache, _), (theirs, _) in zip(mine, ref):
        assert np.array_equal(cache.tokens, theirs.tokens)
