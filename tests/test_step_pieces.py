"""The Engram model's decode step in pieces (dsv4/step_pieces.py) against the one traced graph.

Oracle: the one compiled graph of the same step (itself checked against the reference path in
test_step.py). The pieces run the same operations with the same inputs, so the logits, the draft
stages' inputs and the buffers must be bit-identical; what the pieces change is only when the host
queues what, which the last test checks through the order of the events.
"""

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4 import encode_thread, flags, step, step_pieces
from dsv4.batch_step import SessionsDecoder

FP32 = dict(kv_qdq=False, act_quant=False)


@pytest.fixture(scope="module")
def model(draft_dir):
    with flags.override(draft="on"):
        return dsv4.load(draft_dir, dtype=mx.float32)[0]


def fresh_decoder(model, prompt):
    cache = model.make_cache(reserve=8)
    model(prompt, cache)
    return step.FixedDecoder(model, cache)


def run(model, prompt, schedule, pieces: bool):
    """Every output of the schedule's steps: (n, taken back) feeds with the draft inputs, n = 0
    a one-token decode step; then the buffers after the last."""
    rng = np.random.default_rng(5)
    out = []
    with flags.override(compile=True, engram_pieces=pieces, **FP32):
        dec = fresh_decoder(model, prompt)
        for n, back in schedule:
            if n == 0:
                out.append(dec(mx.array([int(rng.integers(7, 500))])))
                continue
            logits, hidden = dec.feed(mx.array(rng.integers(7, 500, (1, n))), hidden=True)
            out += [logits, *hidden]
            dec.rewind(back)
        mx.eval(out, dec.buffers)
        return out, dict(dec.buffers), dec.host_tokens.copy()


def test_pieces_equal_the_one_graph(model, monkeypatch):
    """Decode steps and verifies of 1..6 positions with rewinds, across ring wraps and buffer
    doublings: every logit, draft input and buffer row bit-identical, the same host tokens."""
    monkeypatch.setattr(step, "MIN_CAPACITY", 4)
    rng = np.random.default_rng(3)
    schedule = [(0, 0)] * 6 + [(int(n), int(rng.integers(0, n))) for n in rng.integers(1, 7, 12)] + [(0, 0)] * 20
    prompt = np.random.default_rng(0).integers(7, 500, (1, 5))
    pieces = run(model, prompt, schedule, pieces=True)
    whole = run(model, prompt, schedule, pieces=False)
    assert len(pieces[0]) == len(whole[0]) > len(schedule)
    for got, want in zip(pieces[0], whole[0]):
        assert got.shape == want.shape and mx.array_equal(got, want).item()
    assert pieces[1].keys() == whole[1].keys()
    for name in whole[1]:
        assert mx.array_equal(pieces[1][name], whole[1][name]).item(), name
    assert np.array_equal(pieces[2], whole[2])
    assert pieces[2].shape[1] == 5 + sum(1 if n == 0 else n - back for n, back in schedule)


def batch_outputs(model, **switches):
    """The server's batch (dsv4/batch_step.py) of three sessions at different positions, 16
    steps with the switches: (every step's logits, each session's host tokens)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(7, 500, (1, n)) for n in (1, 9, 30)]
    with flags.override(compile=True, **FP32, **switches):
        caches = [model.make_cache(reserve=4) for _ in prompts]
        for prompt, cache in zip(prompts, caches):
            model(prompt, cache)
        dec = SessionsDecoder(model, caches)
        out = [dec(mx.array(tokens)) for tokens in rng.integers(7, 500, (16, len(prompts)))]
        mx.eval(out)
        return out, [d.host_tokens.copy() for d in dec.sessions]


def test_the_batch_in_pieces_equals_the_one_graph(model, monkeypatch):
    """The server's batch of sessions at different positions: the same."""
    monkeypatch.setattr(step, "MIN_CAPACITY", 4)
    (got, got_tokens), (want, want_tokens) = batch_outputs(model, engram_pieces=True), batch_outputs(model, engram_pieces=False)
    assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))
    assert all(np.array_equal(g, w) for g, w in zip(got_tokens, want_tokens))
    assert [t.shape[1] for t in got_tokens] == [n + 16 for n in (1, 9, 30)]


@pytest.mark.parametrize("layers,first", [(7, 1), (8, 0), (43, 1), (43, 14), (3, 2)])
def test_spans_cover_the_layers_once_and_double(layers, first):
    spans = step_pieces.spans(layers, first)
    assert spans[0] == (0, first) and spans[1] == (first, first + 1) and spans[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    sizes = [hi - lo for lo, hi in spans[1:]]
    assert all(size == 2 ** i for i, size in enumerate(sizes[:-1])) and 0 < sizes[-1] <= 2 ** (len(sizes) - 1)


@pytest.mark.parametrize("pieces", [True, False])
@pytest.mark.parametrize("batch", [1, 2])
def test_the_layers_before_engram_are_queued_before_the_tokens_reach_the_host(model, monkeypatch, pieces, batch):
    """Per step: a piece is queued (mx.async_eval of the first piece's outputs) before the step
    reads its tokens for Engram's hashing; as one graph, nothing is. The lone decoder and the
    server's batch of two sessions."""
    events = []

    class Logged:   # dsv4.encode_thread as step_pieces sees it, its queueing logged
        def __getattr__(self, name):
            return getattr(encode_thread, name)

        @staticmethod
        def async_eval(*arrays):
            events.append("piece" if isinstance(arrays[0], list) else "tokens")
            return encode_thread.async_eval(*arrays)

    reads = model.start_engram_reads

    def logged_reads(*a):
        events.append("reads")
        return reads(*a)

    monkeypatch.setattr(step_pieces, "encode_thread", Logged())
    monkeypatch.setattr(model, "start_engram_reads", logged_reads)
    with flags.override(compile=True, engram_pieces=pieces, **FP32):
        prompt = np.random.default_rng(0).integers(7, 500, (1, 5))
        if batch == 1:
            dec = fresh_decoder(model, prompt)
        else:
            caches = [model.make_cache(reserve=8) for _ in range(batch)]
            for cache in caches:
                model(prompt, cache)
            dec = SessionsDecoder(model, caches)
        token = mx.array([9] * batch)
        for _ in range(3):
            events.append("step")
            token = mx.argmax(dec(token), axis=-1)
            mx.eval(token)
    steps = " ".join(events).split("step")[1:]
    assert len(steps) == 3
    for logged in steps:
        before = logged.split("reads")[0].split()
        assert ("piece" in before) == pieces, logged
