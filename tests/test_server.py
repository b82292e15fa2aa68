"""The server's OpenAI routes, live on loopback, driven by the real `openai` client.

Two backends: a tiny random checkpoint (dsv4.testing) served by `python -m dsv4.server` in a
subprocess, checked against direct `stream_generate` calls in this process (greedy decoding
is deterministic); and, in-process, the same server code in front of a scripted engine
(tests/server_helpers.py), for what a random model cannot be made to do (emit a tool call, a
stop string, think, run long enough to be cancelled).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from dsv4.encoding import encode_messages, encode_segments, parse_completion  # noqa: E402
from tests.server_helpers import (MAX_CONTEXT, checkpoint, get_json, live, oracle, post_raw,  # noqa: E402,F401
                                  read_until, scripted_server, send_raw, start_server, wait_for)


# --- real model in a subprocess (fixtures checkpoint, oracle, live: tests/server_helpers.py) -----


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model="tiny", messages=messages, **kwargs)


def test_binds_to_loopback_and_lists_the_model(live, checkpoint):
    assert live.host == "127.0.0.1"
    assert get_json(live.host, live.port, "/health") == (200, {"status": "ok"})
    assert [m.id for m in live.client.models.list().data] == [str(checkpoint)]
    claude = anthropic.Anthropic(base_url=live.base, api_key="x", max_retries=0)
    (model,) = claude.models.list().data
    assert model.id == str(checkpoint) and model.type == "model" and model.created_at.year >= 2026
    assert get_json(live.host, live.port, "/v1/models")[1]["data"][0]["max_model_len"] == MAX_CONTEXT


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_equals_direct_generation(live, oracle, thinking):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
    mode = "thinking" if thinking else "chat"
    tokens = oracle.encode(encode_messages(messages, mode))
    text, ids = oracle.generate(tokens)
    expected = parse_completion(text, mode)

    reply = chat(live.client, messages, extra_body={"thinking": {"type": "enabled" if thinking else "disabled"}})
    message = reply.choices[0].message
    assert message.content == expected.content
    assert getattr(message, "reasoning_content", None) == (expected.reasoning if thinking else None)
    assert reply.usage.prompt_tokens == len(tokens)
    assert reply.usage.completion_tokens == sum(t not in oracle.tokenizer.eos_token_ids for t in ids)
    assert reply.choices[0].finish_reason == ("stop" if ids[-1] in oracle.tokenizer.eos_token_ids else "length")


def test_streaming_equals_non_streaming(live):
    messages = [{"role": "user", "content": "Explicit is better than implicit."}]
    whole = chat(live.client, messages, max_tokens=5)
    chunks = list(chat(live.client, messages, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def replayed(oracle, messages, outputs) -> list[int]:
    """The ids a server sends the model for `messages`: each assistant output as the ids the
    model generated for it (outputs, in order; end of sentence left out), the rest as text."""
    ids, text, outputs = [], "", iter(outputs)
    for segment in encode_segments(messages):
        if segment.output:
            ids += oracle.encode(text) + [t for t in next(outputs) if t not in oracle.tokenizer.eos_token_ids]
            text = ""
        else:
            text += segment.text
    return ids + oracle.encode(text)


def test_second_turn_prefills_only_the_new_tokens(live, oracle):
    first = [{"role": "user", "content": "Readability counts. Tell me more."}]
    reply = chat(live.client, first)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "And then?"}]
    tokens1 = oracle.encode(encode_messages(first))
    _, generated = oracle.generate(tokens1)
    tokens2 = replayed(oracle, second, [generated])
    # The answer goes back as the model's own ids, so the cache (the first prompt and every
    # generated token but the last) is a prefix of the second prompt.
    assert tokens2[:len(tokens1) + len(generated) - 1] == tokens1 + generated[:-1]

    again = chat(live.client, second)
    assert again.usage.prompt_tokens == len(tokens2)
    assert again.usage.prompt_tokens_details.cached_tokens == len(tokens1) + len(generated) - 1
    _, stats = get_json(live.host, live.port, "/v1/stats")
    assert stats["last"]["prefilled_tokens"] == len(tokens2) - (len(tokens1) + len(generated) - 1)
    # Reusing the cache changes nothing in the result.
    text, _ = oracle.generate(tokens2)
    assert again.choices[0].message.content == parse_completion(text).content


def test_concurrent_requests_equal_sequential_ones(live):
    requests = [[{"role": "user", "content": f"Number {i}: sparse is better than dense."}] for i in range(4)]
    sequential = [chat(live.client, m).choices[0].message.content for m in requests]
    with ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(lambda m: chat(live.client, m).choices[0].message.content, requests))
    assert concurrent == sequential


def test_text_completions(live, oracle):
    prompt = "Flat is better than nested."
    text, _ = oracle.generate(oracle.encode(prompt), max_tokens=4)
    reply = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
    assert reply.choices[0].text == text
    streamed = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=4, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


def test_seeded_sampling_repeats(live):
    messages = [{"role": "user", "content": "Now is better than never."}]
    a, b = (chat(live.client, messages, temperature=1.0, seed=7).choices[0].message.content for _ in range(2))
    assert a == b


def greedy_with_penalties(oracle, tokens, max_tokens, presence_penalty=0.0, frequency_penalty=0.0,
                          logit_bias=None) -> list[int]:
    """OpenAI's penalties and logit_bias applied in numpy to the model's fp32 logits, token by
    token, each chosen token fed back (the reference decoder's path, as on the CPU)."""
    import mlx.core as mx
    import numpy as np

    cache = oracle.model.make_cache()
    logits = oracle.model(np.array([tokens]), cache)[:, -1]
    bias = np.zeros(logits.shape[-1], np.float32)
    for token, value in (logit_bias or {}).items():
        bias[token] = value
    counts = np.zeros_like(bias)
    out = []
    for _ in range(max_tokens):
        scores = np.array(logits[0].astype(mx.float32)) + bias - np.float32(frequency_penalty) * counts \
            - np.float32(presence_penalty) * (counts > 0).astype(np.float32)
        out.append(int(np.argmax(scores)))
        if out[-1] in oracle.tokenizer.eos_token_ids:
            break
        counts[out[-1]] += 1
        logits = oracle.model(np.array([[out[-1]]]), cache)[:, -1]
    return out


def detokenize(tokenizer, tokens) -> str:
    """The text the server streams for these tokens (end of sentence left out)."""
    detok, pieces = tokenizer.detokenizer, []
    for token in tokens:
        if token not in tokenizer.eos_token_ids:
            detok.add_token(token)
            pieces.append(detok.last_segment)
    detok.finalize()
    return "".join(pieces) + detok.last_segment


@pytest.mark.parametrize("settings", [
    {"frequency_penalty": 2.0},
    {"presence_penalty": 2.0},
    {"frequency_penalty": -0.5, "presence_penalty": 1.0},
    {"logit_bias": {"fox": 5.0}, "frequency_penalty": 1.0},
    {"logit_bias": {"fox": 5.0}, "presence_penalty": 1.5},
])
def test_penalties_and_logit_bias_act_as_the_numpy_oracle_predicts(live, oracle, settings):
    prompt, max_tokens = "The quick brown fox", 24   # long enough for the greedy answer to repeat a token
    tokens = oracle.encode(prompt)
    fox = oracle.encode("fox")[0]
    bias = {fox: v for v in settings.get("logit_bias", {}).values()}
    expected = greedy_with_penalties(oracle, tokens, max_tokens, settings.get("presence_penalty", 0.0),
                                     settings.get("frequency_penalty", 0.0), bias)
    assert expected != greedy_with_penalties(oracle, tokens, max_tokens), "the settings must change the answer"
    body = {**settings, **({"logit_bias": {str(t): v for t, v in bias.items()}} if bias else {})}
    reply = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, extra_body=body)
    assert reply.choices[0].text == detokenize(oracle.tokenizer, expected)
    assert reply.usage.completion_tokens == sum(t not in oracle.tokenizer.eos_token_ids for t in expected)


def test_logit_bias_of_100_forces_its_token(live, oracle):
    fox = oracle.encode("fox")[0]
    messages = [{"role": "user", "content": "Say anything."}]
    reply = chat(live.client, messages, max_tokens=5, logit_bias={str(fox): 100})
    assert reply.choices[0].message.content == detokenize(oracle.tokenizer, [fox] * 5)
    assert reply.choices[0].finish_reason == "length"


CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "x"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize("path, body, status, message, param", [
    (CHAT, b"{not json", 400, "not valid JSON", None),
    (CHAT, b"[1, 2]", 400, "must be a JSON object", None),
    (CHAT, {}, 400, "'messages' must be a non-empty list", "messages"),
    (CHAT, {"messages": []}, 400, "'messages' must be a non-empty list", "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "unsupported role 'robot'", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "is an image", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content: expected a string",
     "messages"),
    # Messages that would encode as empty text.
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0]: a user message needs a non-empty 'content'",
     "messages"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "a user message needs", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": ""}]}, 400, "a user message needs", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": []}]}, 400, "a user message needs", "messages"),
    (CHAT, {"messages": [{"role": "system"}, *HI]}, 400, "messages[0]: a system message needs 'content'",
     "messages"),
    (CHAT, {"messages": HI + [{"role": "assistant"}, *HI]}, 400,
     "messages[1]: an assistant message needs 'content' or 'tool_calls'", "messages"),
    (CHAT, {"messages": HI + [{"role": "assistant", "tool_calls": [CALL]},
                              {"role": "tool", "tool_call_id": "call_1"}]}, 400,
     "messages[2]: a tool message needs a non-empty 'content'", "messages"),
    # Counts and sampling values, as dsv4.sampling checks them.
    (CHAT, {"messages": HI, "max_tokens": 0}, 400, "max_tokens=0: expected an integer >= 1", "max_tokens"),
    (CHAT, {"messages": HI, "max_tokens": "5"}, 400, "max_tokens='5': expected an integer", "max_tokens"),
    (CHAT, {"messages": HI, "max_completion_tokens": 2.5}, 400, "max_completion_tokens=2.5: expected an integer",
     "max_completion_tokens"),
    (CHAT, {"messages": HI, "temperature": -1}, 400, "temperature=-1: expected a number >= 0", "temperature"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400,
     "temperature=nan: expected a finite number", "temperature"),
    (CHAT, {"messages": HI, "top_p": 0}, 400, "top_p=0: expected a number > 0 and <= 1", "top_p"),
    (CHAT, {"messages": HI, "top_p": 1.5}, 400, "top_p=1.5", "top_p"),
    (CHAT, {"messages": HI, "seed": -1}, 400, "seed=-1: expected an integer >= 0", "seed"),
    (CHAT, {"messages": HI, "seed": 1.5}, 400, "seed=1.5", "seed"),
    (CHAT, {"messages": HI, "presence_penalty": 2.5}, 400, "presence_penalty=2.5: expected a number >= -2",
     "presence_penalty"),
    (CHAT, {"messages": HI, "frequency_penalty": "high"}, 400, "frequency_penalty='high': expected a finite",
     "frequency_penalty"),
    (TEXT, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty=-3", "frequency_penalty"),
    (CHAT, {"messages": HI, "logit_bias": [1, 2]}, 400, "'logit_bias' must be an object", "logit_bias"),
    (CHAT, {"messages": HI, "logit_bias": {"fox": 1}}, 400, "logit_bias: 'fox' is not a token id", "logit_bias"),
    (CHAT, {"messages": HI, "logit_bias": {"-1": 1}}, 400, "logit_bias: token -1 is not a token id", "logit_bias"),
    (CHAT, {"messages": HI, "logit_bias": {"512": 1}}, 400, "logit_bias: token 512 is not a token id "
     "(expected an integer >= 0 < 512)", "logit_bias"),
    (CHAT, {"messages": HI, "logit_bias": {"5": 101}}, 400,
     "logit_bias[5]=101: expected a number >= -100 and <= 100", "logit_bias"),
    (CHAT, {"messages": HI, "logit_bias": {"5": "up"}}, 400, "logit_bias[5]='up'", "logit_bias"),
    # Parameters the server does not implement.
    (CHAT, {"messages": HI, "n": 2}, 400, "only n=1", "n"),
    (TEXT, {"prompt": "x", "best_of": 3}, 400, "only best_of=1", "best_of"),
    (TEXT, {"prompt": "x", "echo": True}, 400, "echo is not supported", "echo"),
    (TEXT, {"prompt": "x", "suffix": "end"}, 400, "suffix is not supported", "suffix"),
    (TEXT, {"prompt": "x", "logprobs": 0}, 400, "logprobs are not supported", "logprobs"),
    (CHAT, {"messages": HI, "logprobs": True}, 400, "logprobs are not supported", "logprobs"),
    (CHAT, {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs are not supported", "top_logprobs"),
    (CHAT, {"messages": HI, "functions": [{"name": "f"}]}, 400, "use 'tools'", "functions"),
    (CHAT, {"messages": HI, "function_call": "auto"}, 400, "use 'tool_choice'", "function_call"),
    (CHAT, {"messages": HI, "audio": {"voice": "alloy"}}, 400, "audio output is not supported", "audio"),
    (CHAT, {"messages": HI, "modalities": ["text", "audio"]}, 400, "only the text modality", "modalities"),
    (CHAT, {"messages": HI, "stop": [1]}, 400, "'stop' must be", "stop"),
    (CHAT, {"messages": HI, "stream": "yes"}, 400, "'stream' must be true or false", "stream"),
    (CHAT, {"messages": HI, "tool_choice": "required"}, 400, "tool_choice", "tool_choice"),
    (CHAT, {"messages": HI, "tools": {"a": 1}}, 400, "'tools' must be a list", "tools"),
    (CHAT, {"messages": HI, "reasoning_effort": "extreme"}, 400, "'reasoning_effort' must be", "reasoning_effort"),
    (CHAT, {"messages": HI, "thinking": True}, 400, "'thinking' must be", "thinking"),
    (CHAT, {"messages": HI, "chat_template_kwargs": 1}, 400, "'chat_template_kwargs' must be an object",
     "chat_template_kwargs"),
    (TEXT, {"prompt": ""}, 400, "'prompt' must be a non-empty string", "prompt"),
    ("/v1/embeddings", {"input": "x"}, 404, "no route POST /v1/embeddings", None),
])
def test_malformed_requests_get_clear_errors(live, path, body, status, message, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, reply = post_raw(live.host, live.port, path, data)
    assert code == status
    assert message in reply["error"]["message"]
    assert reply["error"]["param"] == param


@pytest.mark.parametrize("body", [
    {"messages": HI, "n": 1, "best_of": None, "logprobs": False, "top_logprobs": 0, "modalities": ["text"],
     "presence_penalty": 0, "logit_bias": {}},
    {"messages": HI + [{"role": "assistant", "tool_calls": [CALL]},  # tool calls need no content
                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]},
    {"messages": [{"role": "system", "content": ""}, *HI]},
])
def test_neutral_values_and_content_free_tool_calls_are_accepted(live, body):
    code, reply = post_raw(live.host, live.port, CHAT, json.dumps({**body, "max_tokens": 1}).encode())
    assert code == 200, reply
    assert reply["usage"]["completion_tokens"] <= 1


def test_missing_length_and_unknown_get(live):
    connection = http.client.HTTPConnection(live.host, live.port, timeout=30)
    connection.putrequest("POST", "/v1/chat/completions")
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 411 and "Content-Length" in json.loads(response.read())["error"]["message"]
    assert get_json(live.host, live.port, "/v1/nothing")[0] == 404


def test_over_long_prompt_is_refused(live):
    long = [{"role": "user", "content": "word " * 400}]
    with pytest.raises(openai.BadRequestError) as error:
        chat(live.client, long)
    assert error.value.code == "context_length_exceeded"
    assert f"context is {MAX_CONTEXT} tokens" in str(error.value)
    # The server is fine afterwards.
    assert chat(live.client, [{"role": "user", "content": "hi"}], max_tokens=1).usage.completion_tokens <= 1


# --- the same server in front of a scripted engine -------------------------------------------


@pytest.fixture
def scripted():
    """-> start(pieces, **scripted_server options) returning the served namespace plus client."""
    servers = []

    def start(pieces, **options):
        served = scripted_server(pieces, **options)
        served.client = openai.OpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0, timeout=60)
        servers.append(served)
        return served

    yield start
    for served in servers:
        served.stop()


CALL_TEXT = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
             '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
             '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
             '</｜DSML｜ invoke>\n</｜DSML｜ calls>')
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(scripted, stream):
    pieces = ["Let me ", "check.", "\n", "\n"] + [CALL_TEXT[i:i + 7] for i in range(0, len(CALL_TEXT), 7)]
    served = scripted(pieces)
    client, engine = served.client, served.engine
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    if stream:
        chunks = list(chat(client, messages, tools=[WEATHER], stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
        finish = chunks[-1].choices[0].finish_reason
    else:
        reply = chat(client, messages, tools=[WEATHER])
        content, calls, finish = (reply.choices[0].message.content, reply.choices[0].message.tool_calls,
                                  reply.choices[0].finish_reason)
    assert content == "Let me check."
    assert finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})]
    first_prompt = encode_messages(messages, tools=[WEATHER])
    assert engine.prefilled[-1] == first_prompt

    history = messages + [
        {"role": "assistant", "content": content, "tool_calls": [
            {"id": calls[0].id, "type": "function",
             "function": {"name": calls[0].function.name, "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 24 C"}]
    again = chat(client, history, tools=[WEATHER])
    sent = engine.prefilled[-1]
    assert sent == encode_messages(history, tools=[WEATHER])
    assert CALL_TEXT in sent and "<tool_result>sunny, 24 C</tool_result>" in sent
    # The first answer went back as the pieces the engine generated: the cache held all of it.
    assert again.usage.prompt_tokens_details.cached_tokens == len(first_prompt.encode()) + len(pieces)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_output(scripted, stream):
    client = scripted(["alpha ", "be", "ta S", "TOP gam", "ma"]).client
    messages = [{"role": "user", "content": "go"}]
    if stream:
        chunks = list(chat(client, messages, stop=["STOP", "zzz"], stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        reply = chat(client, messages, stop="STOP")
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert (text, finish) == ("alpha beta ", "stop")


def test_thinking_and_reasoning_effort(scripted):
    served = scripted(["I should ", "greet.", "</think>", "Hello!"])
    client, engine = served.client, served.engine
    messages = [{"role": "user", "content": "hi"}]
    reply = chat(client, messages, reasoning_effort="max")
    assert reply.choices[0].message.content == "Hello!"
    assert reply.choices[0].message.reasoning_content == "I should greet."
    assert engine.prefilled[-1] == encode_messages(messages, "thinking", reasoning_effort="max")
    chunks = list(chat(client, messages, extra_body={"thinking": {"type": "enabled"}}, stream=True))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == "I should greet."


@pytest.mark.parametrize("max_sessions", [1, 4])
def test_concurrent_requests_are_decoded_together_up_to_max_sessions(scripted, max_sessions):
    pieces = [chr(ord("a") + i) for i in range(20)]
    served = scripted(pieces, delay=0.02, max_sessions=max_sessions)
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda i: chat(served.client, [{"role": "user", "content": f"q{i}"}]), range(4)))
    assert [r.choices[0].message.content for r in replies] == ["".join(pieces)] * 4
    assert served.engine.largest_batch == max_sessions
    assert get_json(served.host, served.port, "/v1/stats")[1]["largest_batch"] == max_sessions


def wait_for_cancel(host, port, requests_before):
    return wait_for(lambda: (lambda s: s if s["requests"] > requests_before else None)(
        get_json(host, port, "/v1/stats")[1]), what="the generation to end after the client left")


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_generation(scripted, stream):
    served = scripted(["x"] * 100_000, delay=0.005, max_tokens=100_000)
    sock = send_raw(served.host, served.port, "/v1/chat/completions",
                    {"model": "m", "messages": [{"role": "user", "content": "go on forever"}], "stream": stream})
    if stream:
        read_until(sock, b"data:")
    time.sleep(0.3)
    sock.close()
    stats = wait_for_cancel(served.host, served.port, 0)
    assert stats["cancelled"] == 1 and stats["last"]["finish_reason"] == "cancelled"
    assert 0 < stats["last"]["completion_tokens"] < 100_000
    # The server serves the next request normally.
    assert chat(served.client, [{"role": "user", "content": "hi"}], max_tokens=3).choices[0].message.content == "xxx"


def test_client_that_leaves_while_queued_is_skipped(scripted):
    served = scripted(["x"] * 100_000, delay=0.005, max_tokens=100_000, max_sessions=1)
    running = send_raw(served.host, served.port, "/v1/chat/completions",
                       {"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True})
    read_until(running, b"data:")
    queued = send_raw(served.host, served.port, "/v1/chat/completions",
                      {"model": "m", "messages": [{"role": "user", "content": "queued"}]})
    wait_for(lambda: served.scheduler.snapshot()["waiting"] == 1, what="the second request to queue")
    queued.close()
    wait_for(lambda: served.scheduler.snapshot()["waiting"] == 0, what="the queued job to be withdrawn")
    running.close()
    wait_for_cancel(served.host, served.port, 0)
    assert chat(served.client, [{"role": "user", "content": "hi"}], max_tokens=2).choices[0].message.content == "xx"
    stats = get_json(served.host, served.port, "/v1/stats")[1]
    assert stats["requests"] == 2 and stats["cancelled"] == 1
    assert not any("queued" in text for text in served.engine.prefilled)


def test_prompt_cache_can_be_switched_off(live, checkpoint):
    process, host, port = start_server(["--model", str(checkpoint), "--max-tokens", "3", "--no-prompt-cache"])
    try:
        uncached = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Errors should never pass silently."}]
        for client in (uncached, live.client):
            chat(client, messages, max_tokens=3)
        replies = [chat(client, messages, max_tokens=3) for client in (uncached, live.client)]
        assert replies[0].usage.prompt_tokens_details.cached_tokens == 0
        assert replies[1].usage.prompt_tokens_details.cached_tokens == replies[1].usage.prompt_tokens - 1
        assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_stop_cancels_a_prefill_and_refuses_the_queued_requests(scripted):
    # A prompt of ~2100 one-token chunks of 10 ms: 20 s unless the scheduler stops between chunks.
    served = scripted(["x"], delay=0.01, prefill_chunk=1, max_sessions=1)
    long = [{"role": "user", "content": "go " * 700}]
    running = send_raw(served.host, served.port, "/v1/chat/completions", {"messages": long, "stream": True})
    read_until(running, b"data:")  # it started: its prefill is running
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(post_raw, served.host, served.port, "/v1/chat/completions",
                             json.dumps({"messages": [{"role": "user", "content": "next"}]}).encode())
        wait_for(lambda: served.scheduler.snapshot()["waiting"] == 1, what="the second request to queue")
        start = time.monotonic()
        assert served.scheduler.stop(timeout=10)
        assert time.monotonic() - start < 5
        status, reply = queued.result(timeout=10)
    assert status == 503 and "shutting down" in reply["error"]["message"]
    stream = b""
    while b"[DONE]" not in stream:
        piece = running.recv(65536)
        assert piece, stream
        stream += piece
    assert b'"type": "server_error"' in stream and b"shutting down" in stream
    assert encode_messages(long) not in served.engine.prefilled  # the prefill never finished
    stats = get_json(served.host, served.port, "/v1/stats")[1]
    assert stats["cancelled"] == 1 and stats["last"]["finish_reason"] == "cancelled"
    # Nothing new is taken once stopped.
    status, reply = post_raw(served.host, served.port, "/v1/chat/completions", json.dumps({"messages": HI}).encode())
    assert status == 503


def test_ctrl_c_while_generating_stops_cleanly(checkpoint):
    process, host, port = start_server(["--model", str(checkpoint), "--max-tokens", "3000"])
    try:
        running = socket.create_connection((host, port), timeout=60)
        body = json.dumps({"messages": [{"role": "user", "content": "Go on forever"}], "stream": True}).encode()
        running.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                        + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while received.count(b"data:") < 6:  # generating
            piece = running.recv(65536)
            assert piece, received
            received += piece
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        while piece := running.recv(65536):
            received += piece
    finally:
        process.kill()
    output = "".join(process.output)
    assert "terminate called" not in output and "Traceback" not in output, output
    # The stream (chunked) ends with its last event and the closing chunk.
    assert received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") and b"the server is shutting down" in received


def server_cli(*args: str, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv4.server", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def assert_one_error_line(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and all(w in error for w in words), result.stderr


@pytest.mark.parametrize("args, env, words", [
    # Checked before the model is loaded: the bad model path is not what gets reported.
    (["--max-tokens", "0"], {}, ["--max-tokens=0", "expected an integer >= 1"]),
    (["--max-context", "0"], {}, ["--max-context=0"]),
    (["--port", "70000"], {}, ["--port=70000", "0..65535"]),
    (["--max-sessions", "0"], {}, ["--max-sessions=0", "expected an integer >= 1"]),
    (["--kv-cache-mb", "-1"], {}, ["--kv-cache-mb=-1", "MiB >= 0"]),
    ([], {"DSV4_KV_QDQ": "maybe"}, ["DSV4_KV_QDQ"]),
    ([], {}, ["/nonexistent/model: no such directory"]),
])
def test_bad_command_lines_get_one_error_line(args, env, words):
    assert_one_error_line(server_cli("--model", "/nonexistent/model", *args, env=env), *words)


def test_a_taken_port_is_reported_before_the_model_is_loaded():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = server_cli("--model", "/nonexistent/model", "--port", str(port))
    assert_one_error_line(result, f"cannot listen on 127.0.0.1:{port}")


def test_the_context_defaults_to_the_models(checkpoint, oracle):
    context = oracle.model.args.max_position_embeddings
    assert_one_error_line(server_cli("--model", str(checkpoint), "--max-context", str(context + 1)),
                          f"--max-context {context + 1} is more than the model's context ({context} tokens)")
    process, host, port = start_server(["--model", str(checkpoint)])
    try:
        client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        words = "word " * context
        assert len(oracle.encode(words)) >= context
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model="tiny", prompt=words, max_tokens=1)
        assert error.value.code == "context_length_exceeded" and f"context is {context} tokens" in str(error.value)
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0
