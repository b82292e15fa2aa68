"""The fixed-shape decode step (dsv4/step.py) against the reference forward.

Oracle: the reference path (`Model.__call__` over a growing `Cache`), itself checked against
mlx-lm's deepseek_v41 in test_parity_mlx_lm.py. In float32 the two differ only by the order
of fp32 sums (the top-k rows come out in another order), so logits agree to ~1e-6 and the
greedy tokens are identical. Small rings (reserve 4: 14 slots for a window of 8) and a small
first capacity make the rings wrap and the buffers double many times within 64 steps.
"""

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4 import flags, step
from dsv4.generation import stream_generate

FP32 = dict(kv_qdq=False, act_quant=False)


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return dsv4.load(tiny_dir, dtype=mx.float32)


@pytest.fixture(scope="module")
def model(loaded):
    return loaded[0]


@pytest.fixture(scope="module")
def tiny_tokenizer(loaded):
    return loaded[1]


def prompt(n=24, seed=0):
    return np.random.default_rng(seed).integers(7, 500, (1, n))


def reference_run(model, ids, tokens, reserve=4):
    """Logits [V] before each fed token, feeding `tokens` one by one after the prompt."""
    cache = model.make_cache(reserve=reserve)
    logits = model(ids, cache)[:, -1]
    out = []
    for t in tokens:
        out.append(logits[0])
        logits = model(np.array([[t]]), cache)[:, -1]
    out.append(logits[0])
    return mx.stack(out), cache


def greedy_tokens(model, ids, steps):
    cache = model.make_cache()
    logits = model(ids, cache)[:, -1]
    tokens = []
    for _ in range(steps):
        tokens.append(int(mx.argmax(logits[0]).item()))
        logits = model(np.array([[tokens[-1]]]), cache)[:, -1]
    return tokens


def relative(a, b):
    return float(mx.max(mx.abs(a - b)) / mx.max(mx.abs(b)))


@pytest.mark.parametrize("qdq", [False, True])
@pytest.mark.parametrize("prompt_len", [3, 24])
def test_fixed_steps_equal_reference_steps(model, monkeypatch, qdq, prompt_len):
    """Teacher-forced over 64 steps from a short prompt (the index sources go from no rows to
    every row kept to scoring) and a longer one (the candidate blocks in play)."""
    monkeypatch.setattr(step, "MIN_CAPACITY", 4)
    ids = prompt(prompt_len)
    with flags.override(kv_qdq=qdq, act_quant=qdq, compile=False):
        tokens = greedy_tokens(model, ids, 64)
        want, _ = reference_run(model, ids, tokens)
        cache = model.make_cache(reserve=4)
        logits = model(ids, cache)[:, -1]
        dec = step.FixedDecoder(model, cache)
        got = [logits[0]]
        for t in tokens:
            got.append(dec(mx.array([t]))[0])
    got = mx.stack(got)
    assert dec.buffers["2.compressed"].shape[1] > 4   # the buffers grew
    errs = [relative(g, w) for g, w in zip(got, want)]
    # fp32 without the roundings: summation order only. With them, an fp8/fp4 rounding of a
    # value that sits on a boundary can flip; measured max 2e-6 here, bound 1e-3 as in parity.
    assert max(errs) < (1e-3 if qdq else 1e-5), max(errs)
    assert np.array_equal(np.argmax(np.array(got), -1), np.argmax(np.array(want), -1))


def test_compiled_step_equals_uncompiled(model):
    ids = prompt()
    with flags.override(**FP32):
        tokens = greedy_tokens(model, ids, 16)
        runs = []
        for compiled in (False, True):
            with flags.override(compile=compiled):
                cache = model.make_cache()
                model(ids, cache)
                dec = step.FixedDecoder(model, cache)
                runs.append(mx.stack([dec(mx.array([t]))[0] for t in tokens]))
    assert relative(runs[1], runs[0]) < 1e-5


@pytest.mark.parametrize("keep_back", [0, 1, 3])
def test_close_hands_back_the_reference_cache(model, keep_back):
    """After fixed steps, close(keep) leaves a cache that continues (and trims) exactly as
    one the reference built over the same tokens."""
    ids = prompt()
    with flags.override(compile=False, **FP32):
        tokens = greedy_tokens(model, ids, 20)
        cache = model.make_cache(reserve=4)
        model(ids, cache)
        dec = step.FixedDecoder(model, cache)
        for t in tokens:
            dec(mx.array([t]))
        # While decoding, the state lives only in the decoder's buffers (not held twice), and
        # the cache refuses to be used.
        assert all(getattr(lc, name) is None for lc in cache.layers for name in lc.FIELDS)
        for use in (lambda: model(np.array([[5]]), cache), lambda: cache.trim(1), cache.copy):
            with pytest.raises(RuntimeError, match="out with a fixed-shape decoder"):
                use()
        keep = ids.shape[1] + len(tokens) - keep_back
        dec.close(keep)
        assert cache.offset == keep and cache.tokens[0, ids.shape[1]:].tolist() == tokens[:len(tokens) - keep_back]
        ref = model.make_cache(reserve=4)
        model(np.concatenate([ids, [tokens[:len(tokens) - keep_back]]], axis=1), ref)
        # The ring holds its last `ring` positions fed; those past keep took the slots of as
        # many older ones, beyond the one the run-ahead step may take.
        back = 4 - max(keep_back - 1, 0)
        assert cache.max_trim() >= back
        nxt = np.array([[11, 12, 13]])
        assert relative(model(nxt, cache), model(nxt, ref)) < 1e-5
        cache.trim(back)
        ref.trim(back)
        assert relative(model(nxt, cache), model(nxt, ref)) < 1e-5


def test_close_refuses_positions_it_does_not_hold(model):
    cache = model.make_cache()
    model(prompt(5), cache)
    dec = step.FixedDecoder(model, cache)
    with pytest.raises(ValueError, match="can keep 5..5"):
        dec.close(6)


def test_stream_generate_tokens_do_not_depend_on_the_decode_switches(model, tiny_tokenizer):
    """Greedy tokens over 64 steps: reference path vs fixed steps, compiled or not, with the
    next step queued ahead or not; the cache is left holding the same tokens each time."""
    ids = prompt()[0].tolist()
    runs = {}
    with flags.override(**FP32):
        for fixed in ("off", "on"):
            for run_ahead in (False, True):
                with flags.override(fixed_decode=fixed, async_decode=run_ahead):
                    cache = model.make_cache()
                    out = [r.token for r in stream_generate(model, tiny_tokenizer, ids, max_tokens=64,
                                                            cache=cache, ignore_eos=True)]
                    runs[fixed, run_ahead] = out
                    assert cache.tokens[0].tolist() == ids + out[:-1]
    first = runs["off", False]
    assert all(r == first for r in runs.values()), runs


def test_stopping_early_drops_the_step_run_ahead(model, tiny_tokenizer):
    ids = prompt()[0].tolist()
    with flags.override(fixed_decode="on", async_decode=True, **FP32):
        cache = model.make_cache()
        gen = stream_generate(model, tiny_tokenizer, ids, max_tokens=64, cache=cache, ignore_eos=True)
        got = [next(gen).token for _ in range(5)]
        gen.close()
    assert cache.tokens[0].tolist() == ids + got[:-1]


def test_quirk_keeps_the_reference_path(model):
    cache = model.make_cache()
    model(prompt(5), cache)
    with flags.override(fixed_decode="on", index_key_quirk=True):
        assert isinstance(step.decoder(model, cache), step.ReferenceDecoder)
    with flags.override(fixed_decode="on"):
        assert isinstance(step.decoder(model, cache), step.FixedDecoder)
    with flags.override(fixed_decode="auto"):   # this machine's CPU keeps the reference path
        assert isinstance(step.decoder(model, cache), step.ReferenceDecoder)


def test_ring_size_fits_every_ratio():
    assert step.ring_size(128, 256, [0, 2, 1]) == 386
    assert step.ring_size(8, 4, [0, 4]) % 4 == 0 and step.ring_size(8, 4, [0, 4]) >= 13
    assert step.capacity_for(300) == 512 and step.capacity_for(1) == step.MIN_CAPACITY


def test_batch_rows_equal_the_reference_batch(model):
    """Two sequences at once: each row's logits follow the reference path's batch."""
    ids = np.concatenate([prompt(24, seed=1), prompt(24, seed=2)])
    tokens = np.random.default_rng(3).integers(7, 500, (12, 2))
    with flags.override(compile=False, **FP32):
        ref_cache, cache = model.make_cache(reserve=4), model.make_cache(reserve=4)
        model(ids, ref_cache)
        model(ids, cache)
        dec = step.FixedDecoder(model, cache)
        for t in tokens:
            want = model(t[:, None], ref_cache)[:, -1]
            got = dec(mx.array(t))
            assert got.shape == want.shape and relative(got, want) < 1e-5
        dec.close(cache.offset + len(tokens))
    assert cache.tokens.shape == (2, 24 + len(tokens)) and np.array_equal(cache.tokens[:, 24:], tokens.T)


@pytest.fixture(scope="module")
def draft_model(draft_dir):
    with flags.override(draft="on"):
        return dsv4.load(draft_dir, dtype=mx.float32)[0]


@pytest.mark.parametrize("compiled,tails", [(False, False), (True, False), (True, True)])
def test_steps_of_several_positions_and_rewinds_equal_the_reference(draft_model, monkeypatch, compiled, tails):
    """FixedDecoder.feed (a speculative verify: n = 1..6 positions in one step) and rewind,
    against the reference forward over the same chunks and Cache.trim: every position's
    logits and the draft stages' inputs, over a schedule that wraps the rings, doubles the
    buffers, completes groups of every ratio inside a step, and rewinds after most steps.
    Then close() hands back a cache that continues as the reference's. `tails`
    (DSV4_KERNEL_ROWS_POSITIONS): the tails and the attention take each position's angles
    ([S, R]; on the CPU through the kernels' plain definitions)."""
    model = draft_model
    monkeypatch.setattr(step, "MIN_CAPACITY", 4)
    rng = np.random.default_rng(3)
    ids = prompt(5)
    schedule = [(int(n), int(rng.integers(0, n))) for n in rng.integers(1, 7, 24)]   # (fed, taken back)
    with flags.override(compile=compiled, kernel_rows_positions=tails, **FP32):
        ref = model.make_cache(reserve=8)
        model(ids, ref)
        cache = model.make_cache(reserve=8)
        model(ids, cache)
        dec = step.FixedDecoder(model, cache)
        errs, hidden_errs = [], []
        for n, back in schedule:
            chunk = rng.integers(7, 500, (1, n))
            want_hidden = []
            want = model(chunk, ref, hidden=want_hidden)
            got, got_hidden = dec.feed(mx.array(chunk), hidden=True)
            errs.append(relative(got, want))
            assert len(got_hidden) == len(want_hidden) == len(model.args.dspark_target_layer_ids)
            hidden_errs += [relative(g, w) for g, w in zip(got_hidden, want_hidden)]
            ref.trim(back)
            dec.rewind(back)
        assert dec.buffers["2.compressed"].shape[1] > 4   # the buffers grew
        assert dec.pos == ref.offset > dec.ring           # the rings wrapped
        dec.close(dec.pos)
        assert np.array_equal(cache.tokens, ref.tokens)
        nxt = np.array([[11, 12, 13]])
        assert relative(model(nxt, cache), model(nxt, ref)) < 1e-5
    assert max(errs) < 1e-5, errs
    assert max(hidden_errs) < 1e-5, max(hidden_errs)


def test_a_step_may_not_overwrite_the_window_it_reads(draft_model):
    with flags.override(**FP32):
        cache = model_cache(draft_model)
        dec = step.FixedDecoder(draft_model, cache)
        with pytest.raises(ValueError, match="would overwrite window rows"):
            dec.feed(mx.array(np.full((1, dec.room + 1), 9)))
        dec.feed(mx.array(np.full((1, 3), 9)))
        with pytest.raises(ValueError, match="can rewind 0..3 positions, not 4"):
            dec.rewind(4)


def model_cache(model):
    cache = model.make_cache(reserve=4)
    model(prompt(5), cache)
    return cache
