"""/v1/messages and /v1/messages/count_tokens through the real `anthropic` client: the tiny
checkpoint's answers against direct generation, a scripted engine for tool use, thinking and
stop sequences, and Anthropic's error shape."""

from __future__ import annotations

import json

import pytest

anthropic = pytest.importorskip("anthropic")

from dsv4.encoding import encode_messages, parse_completion  # noqa: E402
from tests.server_helpers import checkpoint, live, oracle, post_raw, scripted_server  # noqa: E402,F401

WEATHER = {"name": "get_weather", "description": "Weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
AS_CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                                  "parameters": WEATHER["input_schema"]}}
CALL_TEXT = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
             '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
             '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
             '</｜DSML｜ invoke>\n</｜DSML｜ calls>')


def client_of(base: str):
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=60)


def test_answer_equals_direct_generation_and_counts_match(live, oracle):
    client = client_of(live.base)
    messages = [{"role": "user", "content": "The quick brown fox"}]
    tokens = oracle.encode(encode_messages([{"role": "system", "content": "Be brief."}, *messages]))
    text, ids = oracle.generate(tokens)
    reply = client.messages.create(model="tiny", max_tokens=6, system="Be brief.", messages=messages)
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == parse_completion(text).content
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(tokens)
    assert usage.output_tokens == sum(t not in oracle.tokenizer.eos_token_ids for t in ids)
    assert reply.stop_reason == ("end_turn" if ids[-1] in oracle.tokenizer.eos_token_ids else "max_tokens")
    counted = client.messages.count_tokens(model="tiny", system="Be brief.", messages=messages)
    assert counted.input_tokens == len(tokens)
    # Streamed: the same message, and the prefix cache now holds all of the prompt but its last token.
    with client.messages.stream(model="tiny", max_tokens=6, system="Be brief.", messages=messages) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == reply.content[0].text and final.stop_reason == reply.stop_reason
    assert final.usage.cache_read_input_tokens == len(tokens) - 1 and final.usage.input_tokens == 1


@pytest.fixture
def scripted():
    servers = []

    def start(pieces, **options):
        served = scripted_server(pieces, **options)
        served.client = client_of(served.base)
        servers.append(served)
        return served

    yield start
    for served in servers:
        served.stop()


def create(client, stream: bool, **request):
    if not stream:
        return client.messages.create(model="m", **request)
    with client.messages.stream(model="m", **request) as events:
        return events.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("thinking", [False, True])
def test_tool_use_and_its_result_continue_the_conversation(scripted, stream, thinking):
    reasoning = ["Paris: ", "ask the tool.", "</think>"] if thinking else []
    pieces = reasoning + ["Let me ", "check.", "\n\n"] + [CALL_TEXT[i:i + 9] for i in range(0, len(CALL_TEXT), 9)]
    served = scripted(pieces)
    switch = {"type": "enabled", "budget_tokens": 1024} if thinking else {"type": "disabled"}
    question = [{"role": "user", "content": "Weather in Paris?"}]
    reply = create(served.client, stream, max_tokens=200, tools=[WEATHER], thinking=switch, messages=question)
    mode = "thinking" if thinking else "chat"
    first_prompt = encode_messages(question, mode, tools=[AS_CHAT_TOOL])
    assert served.engine.prefilled[-1] == first_prompt
    assert [b.type for b in reply.content] == (["thinking"] if thinking else []) + ["text", "tool_use"]
    use = reply.content[-1]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris", "days": 2})
    assert reply.stop_reason == "tool_use" and reply.content[-2].text == "Let me check."
    if thinking:
        assert reply.content[0].thinking == "Paris: ask the tool." and reply.content[0].signature

    history = question + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": "sunny, 24 C"}]}]
    again = create(served.client, stream, max_tokens=200, tools=[WEATHER], thinking=switch, messages=history)
    expected = question + [
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Paris: ask the tool." if thinking else "",
         "tool_calls": [{"id": use.id, "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny, 24 C"}]
    assert served.engine.prefilled[-1] == encode_messages(expected, mode, tools=[AS_CHAT_TOOL])
    # The first answer went back as the pieces the engine generated: all of it was cached.
    assert again.usage.cache_read_input_tokens == len(first_prompt.encode()) + len(pieces)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(scripted, stream):
    served = scripted(["alpha ", "be", "ta S", "TOP gam", "ma"])
    reply = create(served.client, stream, max_tokens=50, stop_sequences=["STOP", "zzz"],
                   messages=[{"role": "user", "content": "go"}])
    assert reply.content[0].text == "alpha beta "
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "STOP")


def test_length_ends_with_max_tokens(scripted):
    served = scripted(["a", "b", "c", "d"])
    reply = create(served.client, False, max_tokens=2, messages=[{"role": "user", "content": "go"}])
    assert (reply.content[0].text, reply.stop_reason, reply.usage.output_tokens) == ("ab", "max_tokens", 2)


HI = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("path, body, status, kind, message", [
    ("/v1/messages", {"messages": HI}, 400, "invalid_request_error", "'max_tokens' is required"),
    ("/v1/messages", {"max_tokens": 5}, 400, "invalid_request_error", "'messages' must be a non-empty list"),
    ("/v1/messages", {"max_tokens": 0, "messages": HI}, 400, "invalid_request_error", "max_tokens=0"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error", "role must be user or assistant"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}, 400,
     "invalid_request_error", "reads text only"),
    ("/v1/messages", {"max_tokens": 5, "messages": HI + [{"role": "assistant", "content": "The"}]}, 400,
     "invalid_request_error", "prefill"),
    ("/v1/messages", {"max_tokens": 5, "messages": HI, "tools": [{"type": "web_search_20250305", "name": "w"}]},
     400, "invalid_request_error", "only custom tools"),
    ("/v1/messages", {"max_tokens": 5, "messages": HI, "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error", "tool_choice"),
    ("/v1/messages", {"max_tokens": 5, "messages": HI, "top_k": 5}, 400, "invalid_request_error",
     "top_k is not supported"),
    ("/v1/messages", {"max_tokens": 5, "messages": HI, "temperature": -1}, 400, "invalid_request_error",
     "temperature=-1"),
    ("/v1/messages", {"max_tokens": 5, "messages": HI, "stop_sequences": [1]}, 400,
     "invalid_request_error", "'stop_sequences' must be"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "word " * 400}]}, 400,
     "invalid_request_error", "context is 300 tokens"),
    ("/v1/messages/count_tokens", {"messages": 5}, 400, "invalid_request_error", "'messages' must be"),
    ("/v1/messages/nothing", {}, 404, "not_found_error", "no route POST /v1/messages/nothing"),
])
def test_bad_requests_get_anthropic_errors(live, path, body, status, kind, message):
    code, reply = post_raw(live.host, live.port, path, json.dumps(body).encode())
    assert code == status, reply
    assert reply["type"] == "error" and reply["error"]["type"] == kind and message in reply["error"]["message"]


def test_the_client_raises_anthropic_errors(live):
    client = client_of(live.base)
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model="tiny", max_tokens=0, messages=HI)
    assert error.value.body["error"]["type"] == "invalid_request_error"
    code, reply = post_raw(live.host, live.port, "/v1/messages", b"{not json")
    assert code == 400 and reply["type"] == "error" and "not valid JSON" in reply["error"]["message"]
