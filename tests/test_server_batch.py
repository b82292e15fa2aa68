"""Sessions decoded together: 8 concurrent greedy sessions on the tiny checkpoint answer exactly as
each alone and leave exactly the caches a sequential run leaves; a request that arrives joins the
batch between steps; a long prompt's prefill does not hold up a short one behind it; a client
that leaves is cancelled without disturbing the others; seeded sampling does not depend on what
is decoded alongside."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from dsv4.encoding import encode_messages, parse_completion  # noqa: E402
from dsv4.generation import stream_generate  # noqa: E402
from tests.server_helpers import (get_json, inprocess_server, model_server, read_until, scripted_server,  # noqa: E402
                                  send_raw, wait_for)

QUESTIONS = [f"Session {i}: " + "flat is better than nested. " * (1 + 3 * i) for i in range(8)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def oracle(tiny_dir):
    import dsv4

    return dsv4.load(str(tiny_dir))


def chat(client, question, **options):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                          max_tokens=MAX_TOKENS, **options)


def assert_same_cache(a, b):
    assert a.offset == b.offset and np.array_equal(a.tokens, b.tokens)
    for mine, theirs in zip(a.layers, b.layers):
        for name in mine.FIELDS:
            x, y = getattr(mine, name), getattr(theirs, name)
            assert (x is None) == (y is None), name
            if x is not None:
                assert x.shape == y.shape and mx.array_equal(x, y).item(), name


def test_eight_concurrent_sessions_answer_and_cache_as_each_alone(tiny_dir, oracle):
    model, tokenizer = oracle
    served = model_server(tiny_dir, max_sessions=8, max_context=4096)
    client = openai.OpenAI(base_url=served.base + "/v1", api_key="x", max_retries=0, timeout=120)
    start = threading.Barrier(8)

    def ask(question):
        start.wait()
        return chat(client, question)

    try:
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, QUESTIONS))
        stats = get_json(served.host, served.port, "/v1/stats")[1]
        assert stats["largest_batch"] >= 4   # they were decoded together, not in turn
        entries = served.scheduler.prefix.entries
        for question, reply in zip(QUESTIONS, replies):
            prompt = tokenizer.encode(encode_messages([{"role": "user", "content": question}]))
            cache = model.make_cache()
            responses = list(stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, cache=cache))
            assert reply.choices[0].message.content == parse_completion("".join(r.text for r in responses)).content
            held = np.array(prompt + [r.token for r in responses][:-1])
            kept = [e for e in entries.values() if np.array_equal(e.tokens, held)]
            assert len(kept) == 1, "each session's cache is in the prefix cache"
            assert_same_cache(kept[0].cache, cache)
    finally:
        served.stop()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_lone_session_runs_ahead_and_answers_and_caches_as_without(tiny_dir, oracle, monkeypatch, temperature):
    """A lone session's next step is queued on its token still on the device (the engine's
    runs_ahead, DSV4_ASYNC_DECODE): the answers (greedy and seeded sampling) and the cache kept
    for the prefix cache (the step queued past the last token dropped) equal the server's
    without it, and the steps did run ahead."""
    from dsv4 import flags

    ahead = []
    results = {}
    for runs_ahead in (False, True):
        with flags.override(async_decode=runs_ahead):
            served = model_server(tiny_dir, max_sessions=8, max_context=4096)
            engine = served.scheduler.engine
            decode = engine.decode
            monkeypatch.setattr(engine, "decode", lambda caches, tokens: (
                ahead.append(runs_ahead) if isinstance(tokens, mx.array) else None) or decode(caches, tokens))
            client = openai.OpenAI(base_url=served.base + "/v1", api_key="x", max_retries=0, timeout=120)
            try:
                replies = [chat(client, q, temperature=temperature, seed=5).choices[0].message.content
                           for q in QUESTIONS[:2]]
                entries = sorted(served.scheduler.prefix.entries.values(), key=lambda e: len(e.tokens))
                results[runs_ahead] = replies, entries
            finally:
                served.stop()
    assert results[True][0] == results[False][0]
    assert ahead and all(ahead)   # only the run-ahead server fed device tokens, and it did
    assert len(results[True][1]) == len(results[False][1]) > 0
    for mine, theirs in zip(results[True][1], results[False][1]):
        assert np.array_equal(mine.tokens, theirs.tokens)
        assert_same_cache(mine.cache, theirs.cache)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_dir):
    served = model_server(tiny_dir, max_sessions=8, max_context=4096)
    client = openai.OpenAI(base_url=served.base + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        alone = chat(client, QUESTIONS[0], temperature=1.0, seed=11).choices[0].message.content
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda q: chat(client, q, temperature=1.0, seed=11 if q == QUESTIONS[0] else None),
                                     QUESTIONS[:4]))
        assert together[0].choices[0].message.content == alone
    finally:
        served.stop()


def timed_stream(client, question, **options):
    """-> (seconds to the first content, seconds to the end, text)."""
    begin = time.monotonic()
    first, text = None, []
    for chunk in client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                                stream=True, **options):
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            first = first if first is not None else time.monotonic() - begin
            text.append(delta)
    return first, time.monotonic() - begin, "".join(text)


def test_a_short_prompt_is_not_held_up_behind_a_long_prefill():
    # One-token chunks of 10 ms: the long prompt takes ~20 s to prefill, the short one ~0.5 s.
    served = scripted_server(["x", "y"], delay=0.01, prefill_chunk=1)
    client = openai.OpenAI(base_url=served.base + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(timed_stream, client, "go " * 700)
            wait_for(lambda: served.scheduler.snapshot()["active"] == 1, what="the long prompt to start")
            first, _, text = timed_stream(client, "short")
            assert text == "xy" and first < 5
            assert not long.done()   # its prefill goes on, a chunk in turn with the short one
            served.scheduler.stop(timeout=10)
    finally:
        served.stop()


def test_a_request_joins_the_running_batch_and_a_leaving_client_leaves_it():
    served = scripted_server(["t"] * 400, delay=0.01, max_tokens=400)
    client = openai.OpenAI(base_url=served.base + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        leaving = send_raw(served.host, served.port, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "leave"}], "stream": True})
        read_until(leaving, b"data:")
        with ThreadPoolExecutor(1) as pool:
            staying = pool.submit(timed_stream, client, "stay", max_tokens=60)
            wait_for(lambda: served.engine.largest_batch == 2, what="the second request to join the batch")
            leaving.close()
            _, _, text = staying.result(timeout=60)
        assert text == "t" * 60
        stats = get_json(served.host, served.port, "/v1/stats")[1]
        assert stats["cancelled"] == 1 and stats["requests"] == 2 and stats["active"] == 0
    finally:
        served.stop()


def test_streamed_experts_batched_as_segments_answer_as_each_alone(tiny_dir, oracle):
    """The server over a model whose routed experts stream from disk into the least cache
    (--expert-cache-gb), its batches at fixed shapes as compiled segments (forced on the CPU; in
    fp32, where the fixed-shape steps give the reference path's greedy tokens): 4 concurrent
    sessions, decoded 2-4 at a time, answer as each alone on the resident model."""
    import dsv4
    from dsv4 import flags
    from dsv4.serve.disk_cache import model_fingerprint
    from dsv4.serve.engine import ModelEngine

    _, tokenizer = oracle
    fp32 = dict(kv_qdq=False, act_quant=False)
    least = dsv4.load(str(tiny_dir), expert_cache_gb="1000")[0].expert_store.least_bytes
    streamed = {}

    def load():
        model, tok = dsv4.load(str(tiny_dir), dtype=mx.float32, expert_cache_gb=f"{least / 1e9:.9f}")
        streamed["model"] = model
        return ModelEngine(model, tok, model_fingerprint(tiny_dir))

    questions = QUESTIONS[:4]
    with flags.override(fixed_decode=True, batch_fixed_decode=True, compile=True, expert_step_segments=True, **fp32):
        served = inprocess_server(load, max_sessions=4, max_context=4096)
        client = openai.OpenAI(base_url=served.base + "/v1", api_key="x", max_retries=0, timeout=120)
        start = threading.Barrier(len(questions))

        def ask(question):
            start.wait()
            return chat(client, question)

        try:
            with ThreadPoolExecutor(len(questions)) as pool:
                replies = list(pool.map(ask, questions))
            stats = get_json(served.host, served.port, "/v1/stats")[1]
        finally:
            served.stop()
    model = streamed["model"]
    assert stats["largest_batch"] >= 2   # decoded together
    assert {type(f).__name__ for f in model._fixed_batch_steps.values()} == {"SegmentedStep"}
    assert model.expert_store.totals().misses > 0
    model.expert_store.close()
    resident = dsv4.load(str(tiny_dir), dtype=mx.float32)[0]
    with flags.override(**fp32):
        for question, reply in zip(questions, replies):
            prompt = tokenizer.encode(encode_messages([{"role": "user", "content": question}]))
            text = "".join(r.text for r in stream_generate(resident, tokenizer, prompt, max_tokens=MAX_TOKENS))
            assert reply.choices[0].message.content == parse_completion(text).content
