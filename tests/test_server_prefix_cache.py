"""The prefix cache: an agent's turns prefill only what is new, in memory and, with the disk tier,
after a restart; sessions taking turns keep their entries within the memory bound; the disk
tier's files appear whole or not at all, stay within their bound and are read back only by the
model that wrote them; the bytes per token benchmarks/cache_bytes.py reports are the cache's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from benchmarks import cache_bytes  # noqa: E402
from dsv4 import flags  # noqa: E402
from dsv4.encoding import encode_segments, parse_completion  # noqa: E402
from dsv4.generation import prefill  # noqa: E402
from dsv4.serve.disk_cache import DiskTier, key_of, model_fingerprint  # noqa: E402
from dsv4.serve.engine import ModelEngine  # noqa: E402
from dsv4.serve.prefix_cache import PrefixCache  # noqa: E402
from dsv4.serve.scheduler import CacheOptions  # noqa: E402
from tests.server_helpers import (ListCache, checkpoint, get_json, oracle, scripted_server,  # noqa: E402,F401
                                  start_server)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}, "days": {"type": "integer"}}}}}
CALL_TEXT = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
             '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
             '<｜DSML｜ parameter name="days" string="false">2.50</｜DSML｜ parameter>\n'
             '</｜DSML｜ invoke>\n</｜DSML｜ calls>')
# The call as the model writes it: "2.50" comes back from the client as 2.5, which the encoder
# would render differently; only the replayed ids make the next prompt extend the cache.
PIECES = ["Checking", " the", " weather.", "\n\n"] + [CALL_TEXT[i:i + 11] for i in range(0, len(CALL_TEXT), 11)]


def client_of(served):
    return openai.OpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0, timeout=60)


def new_tokens(messages) -> int:
    """Bytes (the scripted engine's prompt ids) of the prompt after its last assistant output."""
    segments = encode_segments(messages, tools=[WEATHER])
    last = max(i for i, s in enumerate(segments) if s.output)
    return len("".join(s.text for s in segments[last + 1:]).encode())


def agent_turn(client, history: list, n: int) -> tuple:
    """One turn: the model calls the tool; the next message is its result (every third turn a
    new user message instead). -> (reply usage, history after it)."""
    reply = client.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    message = reply.choices[0].message
    call = message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2.5})
    history = history + [{"role": "assistant", "content": message.content, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]}]
    if n % 3 == 2:
        history += [{"role": "tool", "tool_call_id": call.id, "content": f"cloudy, {n} C"},
                    {"role": "user", "content": f"And on day {n}?"}]
    else:
        history += [{"role": "tool", "tool_call_id": call.id, "content": f"sunny, {20 + n} C"}]
    return reply.usage, history


def test_agent_transcript_prefills_only_new_tokens_then_resumes_from_disk(tmp_path):
    cache = CacheOptions(disk_dir=str(tmp_path / "kv"))
    served = scripted_server(PIECES, cache=cache)
    client = client_of(served)
    history = [{"role": "system", "content": "You are a weather agent."},
               {"role": "user", "content": "Weather in Paris?"}]
    previous = None
    try:
        for n in range(10):
            asked = history
            usage, history = agent_turn(client, asked, n)
            if previous is not None:
                # All of the last prompt and the answer (but its end of sentence, never fed).
                assert usage.prompt_tokens_details.cached_tokens == previous.prompt_tokens + len(PIECES), n
                assert usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens == new_tokens(asked)
                stats = get_json(served.host, served.port, "/v1/stats")[1]
                assert stats["last"]["prefilled_tokens"] == new_tokens(asked)
            previous = usage
        served.scheduler.prefix.disk.flush()
        stats = get_json(served.host, served.port, "/v1/stats")[1]["prefix_cache"]
        # One entry per turn boundary: each prompt covers the answer before it.
        assert stats["entries"] == 1 and stats["disk"]["entries"] == 1
    finally:
        served.stop()

    resumed = scripted_server(PIECES, cache=cache)
    try:
        usage, _ = agent_turn(client_of(resumed), history, 10)
        assert usage.prompt_tokens_details.cached_tokens == previous.prompt_tokens + len(PIECES)
        stats = get_json(resumed.host, resumed.port, "/v1/stats")[1]
        assert stats["prefix_cache"]["disk_hits"] == 1 and stats["last"]["prefilled_tokens"] == new_tokens(history)
    finally:
        resumed.stop()


def test_interleaved_sessions_keep_their_entries_within_the_memory_bound():
    served = scripted_server(PIECES, cache=CacheOptions(memory_bytes=3 * 8 * 1200))   # ~3 sessions of 1200 ids
    client = client_of(served)
    sessions = {name: [{"role": "user", "content": f"Weather in Paris, says {name}?"}] for name in "AB"}
    seen = {}
    try:
        for n in range(5):
            for name in "AB":
                usage, sessions[name] = agent_turn(client, sessions[name], n)
                if n:
                    assert usage.prompt_tokens_details.cached_tokens == seen[name].prompt_tokens + len(PIECES)
                seen[name] = usage
        stats = get_json(served.host, served.port, "/v1/stats")[1]["prefix_cache"]
        assert stats["entries"] == 2 and stats["bytes"] <= stats["limit_bytes"]
        # A third, long session takes more than the bound leaves: the least recently used (A) goes.
        long = [{"role": "user", "content": "Weather? " + "Paris " * 2000}]
        agent_turn(client, long, 0)
        usage, _ = agent_turn(client, sessions["A"], 5)
        assert usage.prompt_tokens_details.cached_tokens == 0
        stats = get_json(served.host, served.port, "/v1/stats")[1]["prefix_cache"]
        assert stats["bytes"] <= stats["limit_bytes"]
    finally:
        served.stop()


# --- the tiny checkpoint: real caches, trimmed, written and read back -----------------------


def test_model_transcript_and_restart_give_what_fresh_prefills_give(checkpoint, oracle, tmp_path):
    """Two sessions take turns for 10 turns on the tiny checkpoint with the disk tier; the server
    restarts; each answer equals a fresh generation from the prompt ids the server sends (each
    earlier answer as the ids the model generated), and each turn prefills only its new part."""
    args = ["--model", str(checkpoint), "--max-tokens", "5", "--kv-disk-dir", str(tmp_path / "kv")]
    sessions = {name: [{"role": "user", "content": f"{name}: the quick brown fox"}] for name in "AB"}
    outputs = {name: [] for name in "AB"}
    held = {}   # session -> the ids its cache entry holds

    def turn(client, name):
        messages = sessions[name]
        ids, text, produced = [], "", iter(outputs[name])
        for segment in encode_segments(messages):
            if segment.output:
                ids += oracle.encode(text) + [t for t in next(produced) if t not in oracle.tokenizer.eos_token_ids]
                text = ""
            else:
                text += segment.text
        ids += oracle.encode(text)
        expected, generated = oracle.generate(ids, max_tokens=5)
        reply = client.chat.completions.create(model="tiny", messages=messages)
        assert reply.choices[0].message.content == parse_completion(expected).content
        assert reply.usage.prompt_tokens == len(ids)
        if name in held:
            assert ids[:len(held[name])] == held[name]
            assert reply.usage.prompt_tokens_details.cached_tokens == len(held[name])
        held[name] = ids + generated[:-1]
        outputs[name].append(generated)
        sessions[name] = messages + [{"role": "assistant", "content": reply.choices[0].message.content},
                                     {"role": "user", "content": f"{name} goes on."}]

    for attempt in range(2):
        process, host, port = start_server(args)
        try:
            client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0, timeout=120)
            for _ in range(5 if attempt == 0 else 1):
                for name in "AB":
                    turn(client, name)
            stats = get_json(host, port, "/v1/stats")[1]["prefix_cache"]
            if attempt == 1:
                assert stats["disk_hits"] == 2 and stats["disk"]["loaded"] == 2
        finally:
            process.terminate()
            assert process.wait(timeout=30) == 0


def test_bytes_per_token_are_as_the_benchmark_computes(tiny_dir):
    import dsv4

    model, _ = dsv4.load(str(tiny_dir))
    cache = model.make_cache()
    fed = 0
    for chunk in (1, 7, 300, 5, 400, 1):   # chunks and single tokens, past the window's cuts
        prefill(model, (np.arange(fed, fed + chunk) % 500).reshape(1, -1), cache)
        fed += chunk
        growing, bounded = cache_bytes.measured(cache)
        assert growing == cache_bytes.expected_growing(model.args, fed)
        assert bounded <= cache_bytes.bounded_bytes(model.args, cache.reserve)
        assert cache.nbytes() == growing + bounded
    v41 = cache_bytes.v41_flash()
    assert cache_bytes.growing_bytes_per_token(v41) == 8 + 3 * (512 + 128) * 2 / 2 + (512 + 128) * 2


# --- the disk tier on its own --------------------------------------------------------------


def tier(directory, fingerprint="model-a", max_bytes=1 << 20):
    def load(path):
        arrays, metadata = mx.load(str(path), return_metadata=True)
        return ListCache(np.array(arrays["tokens"]).reshape(-1).tolist()), metadata

    return DiskTier(directory, max_bytes, fingerprint, load)


def test_entries_survive_and_unreadable_files_are_dropped(tmp_path):
    first = tier(tmp_path)
    for tokens in ([1, 2, 3], [7, 8, 9, 10]):
        first.put(tokens, ListCache(tokens))
    first.flush()
    leftover = first.directory / ("f" * 64 + ".safetensors.partial")
    leftover.write_bytes(b"half a file")
    good = first.path(key_of(np.array([7, 8, 9, 10])))
    truncated = first.directory / (key_of(np.array([4, 5])) + ".safetensors")
    truncated.write_bytes(good.read_bytes()[:40])
    misnamed = first.directory / (key_of(np.array([6])) + ".safetensors")
    misnamed.write_bytes(good.read_bytes())   # whole, but not what its name says

    again = tier(tmp_path)
    assert sorted(len(e.tokens) for e in again.entries.values()) == [3, 4]
    assert not leftover.exists() and not truncated.exists() and not misnamed.exists()
    assert again.counts["dropped_unreadable"] == 2
    assert again.best(np.array([7, 8, 9, 10, 11]))[1] == 4
    assert again.load(key_of(np.array([7, 8, 9, 10])))[1].tokens == [7, 8, 9, 10]
    # Another model's tier is a directory of its own: nothing of model-a is read back.
    assert tier(tmp_path, fingerprint="model-b").entries == {}


KILLED_WRITER = """
import sys, time
import mlx.core as mx, numpy as np
from dsv4.serve.disk_cache import DiskTier

class Slow:
    offset = 3
    def max_trim(self): return 3
    def save(self, f, metadata):
        f.write(b"x" * 4096); f.flush()
        print("writing", flush=True)
        time.sleep(60)

tier = DiskTier(sys.argv[1], 1 << 20, "model-a", None)
tier.put([1, 2, 3], Slow())
tier.flush()
"""


def test_a_writer_killed_mid_write_leaves_no_file_that_loads(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    partial = list(tmp_path.glob("*/*.partial"))
    assert len(partial) == 1 and partial[0].stat().st_size == 4096
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(timeout=30)
    after = tier(tmp_path)
    assert after.entries == {} and not list(tmp_path.glob("*/*.partial"))


def test_the_disk_tier_keeps_within_its_bound_dropping_the_least_recently_used(tmp_path):
    probe = tier(tmp_path / "probe")
    probe.put(list(range(100)), ListCache(range(100)))
    probe.flush()
    size = probe.nbytes
    bounded = tier(tmp_path / "t", max_bytes=int(2.5 * size))
    runs = [list(range(s, s + 100)) for s in (1000, 2000, 3000)]
    for n, run in enumerate(runs):
        bounded.put(run, ListCache(run))
        bounded.flush()
        time.sleep(0.01)
        if n == 1:
            bounded.load(key_of(np.array(runs[0])))   # used: now the most recent
            time.sleep(0.01)
    assert bounded.nbytes <= 2.5 * size
    kept = sorted(int(e.tokens[0]) for e in bounded.entries.values())
    assert kept == [1000, 3000]
    assert sorted(p.name for p in bounded.directory.iterdir()) == sorted(
        key_of(np.array(r)) + ".safetensors" for r in (runs[0], runs[2]))


def test_the_fingerprint_names_the_weights_and_the_switches(tiny_dir, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before
    with flags.override(kv_qdq=not flags.get("kv_qdq")):
        assert model_fingerprint(model) != before
    shard = sorted(model.glob("model-*.safetensors"))[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1))
    assert model_fingerprint(model) != before


def test_a_memory_entry_is_trimmed_back_exactly(tiny_dir):
    """A real cache found by a shorter prompt is trimmed to the shared prefix and continues as a
    fresh prefill of that prefix would."""
    import dsv4

    model, tokenizer = dsv4.load(str(tiny_dir))
    prefix = PrefixCache(ModelEngine(model, tokenizer), 1 << 30)
    long = list(range(3, 60))
    cache = model.make_cache()
    prefill(model, np.array([long]), cache)
    prefix.insert(long, cache)
    prompt = long[:40] + [400, 401]
    reused, cached = prefix.lookup(prompt)
    assert cached == 40 and reused.offset == 40
    logits = prefill(model, np.array([prompt[cached:]]), reused)
    fresh = model.make_cache()
    assert np.array_equal(np.array(logits), np.array(prefill(model, np.array([prompt]), fresh)))
    assert prefix.counts["memory_hits"] == 1 and prefix.counts["reused_tokens"] == 40
