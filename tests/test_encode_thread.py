"""The decode loop with MLX's encoding on a thread of its own (DSV4_ENCODE_THREAD,
dsv4/encode_thread.py) against the same loop encoding on its own thread.

Oracle: the loop with the switch off (itself checked against the reference path by
test_step.py). Greedy and sampled tokens must be the same, step for step, over enough steps for
the fixed-shape step's rings to wrap and its buffers to grow (new traced graphs built while a
step is being encoded), and the cache must hold the same tokens after the loop is stopped early.
"""

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4 import encode_thread, engram_queued, flags, step
from dsv4.generation import stream_generate

FP32 = dict(kv_qdq=False, act_quant=False, fixed_decode="on", async_decode=True)


@pytest.fixture(scope="module")
def loaded(tiny_no_engram_dir):
    return dsv4.load(tiny_no_engram_dir, dtype=mx.float32)


@pytest.fixture
def queued(monkeypatch):
    """How many steps went to an encoder thread (not counting its drains, which queue nothing)."""
    count = []
    queue = encode_thread.EncodeThread.queue
    monkeypatch.setattr(encode_thread.EncodeThread, "queue", lambda self, a: (a and count.append(1)) or queue(self, a))
    return count


def prompt(seed: int) -> list:
    return np.random.default_rng(seed).integers(7, 500, 24).tolist()


def run(loaded, threaded: bool, max_tokens: int, ids=prompt(5), **sampling):
    model, tokenizer = loaded
    cache = model.make_cache(reserve=4)
    with flags.override(encode_thread=threaded, **FP32):
        out = [r.token for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, cache=cache,
                                                ignore_eos=True, **sampling)]
    assert cache.tokens[0].tolist() == ids + out[:-1]
    return out


@pytest.mark.parametrize("sampling", [{}, dict(temp=0.8, top_p=0.9, seed=3)], ids=["greedy", "sampled"])
def test_tokens_are_the_loops_own(loaded, queued, sampling):
    plain = run(loaded, False, 48, **sampling)
    assert not queued
    threaded = run(loaded, True, 48, **sampling)
    assert len(queued) == 47   # every step but the last token's, which is not fed
    assert threaded == plain


def test_stopping_early_keeps_the_tokens_handed_out(loaded, queued):
    model, tokenizer = loaded
    ids = prompt(6)
    with flags.override(encode_thread=True, **FP32):
        cache = model.make_cache(reserve=4)
        gen = stream_generate(model, tokenizer, ids, max_tokens=64, cache=cache, ignore_eos=True)
        got = [next(gen).token for _ in range(7)]
        gen.close()
    assert queued and cache.tokens[0].tolist() == ids + got[:-1]
    assert run(loaded, False, 7, ids)[:7] == got


@pytest.mark.parametrize("engram", [dict(engram_pieces=True), dict(engram_pieces=False)], ids=["pieces", "one-graph"])
def test_engram_steps_tokens_are_the_loops_own(tiny_dir, queued, engram):
    """With Engram the step brings its tokens to the host while it is built: through the
    encoder's thread, in order. Greedy tokens over 24 steps. (Queued reads go through it too
    where they share the step's stream, on CUDA; off CUDA they keep the loop's thread: below.)"""
    loaded = dsv4.load(tiny_dir, dtype=mx.float32)
    with flags.override(**engram):
        plain = run(loaded, False, 24)
        threaded = run(loaded, True, 24)
    assert len(queued) >= 23 and threaded == plain


def test_steps_that_evaluate_or_exchange_keep_the_loops_thread(tiny_dir, monkeypatch):
    """Streamed experts' lookups evaluate the routing mid-step, a rank of several exchanges on
    streams of its own, and queued Engram reads may run on a CPU stream of their own: no encoder
    thread."""
    model, _ = dsv4.load(tiny_dir, dtype=mx.float32)
    cache = model.make_cache()
    model(np.array([[7, 8, 9]]), cache)
    with flags.override(fixed_decode="on"):
        assert step.FixedDecoder(model, cache).lazy_steps
        with monkeypatch.context() as m:
            m.setattr(type(model.plan), "size", property(lambda plan: 2))
            assert not step.FixedDecoder(model, cache).lazy_steps
        with monkeypatch.context() as m:   # queued Engram reads on a CPU stream of their own
            m.setattr(engram_queued, "applies", lambda model: True)
            m.setattr(engram_queued, "reads_stream_of_their_own", lambda: True)
            assert not step.FixedDecoder(model, cache).lazy_steps
        monkeypatch.setattr(model, "expert_store", object(), raising=False)
        assert not step.FixedDecoder(model, cache).lazy_steps
    with flags.override(fixed_decode="on", compile=False):
        assert not step.decoder(model, cache).lazy_steps


def test_an_encoding_error_reaches_the_waiter():
    """An array built outside `building` is of this thread's stream, which the encoder's thread
    cannot encode: MLX's error is raised here, and the thread goes on encoding."""
    encoder = encode_thread.shared()
    with pytest.raises(RuntimeError, match="Stream"):
        encoder.queue([mx.ones(3) + 1]).wait()
    with encode_thread.building(encoder):
        x = mx.arange(4) * 3
    encoder.queue([x]).wait()
    assert x.tolist() == [0, 3, 6, 9]
