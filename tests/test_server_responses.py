"""/v1/responses through the real `openai` client: the tiny checkpoint's answers against direct
generation, and a scripted engine for tool calls, reasoning and previous_response_id."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

from dsv4.encoding import encode_messages, parse_completion  # noqa: E402
from tests.server_helpers import checkpoint, get_json, live, oracle, post_raw, scripted_server  # noqa: E402,F401

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
AS_CHAT_TOOL = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
CALL_TEXT = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
             '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
             '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
             '</｜DSML｜ invoke>\n</｜DSML｜ calls>')


def test_answer_equals_direct_generation(live, oracle):
    question = "The quick brown fox"
    tokens = oracle.encode(encode_messages([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": question}]))
    text, ids = oracle.generate(tokens)
    reply = live.client.responses.create(model="tiny", instructions="Be brief.", input=question)
    assert reply.output_text == parse_completion(text).content
    assert reply.usage.input_tokens == len(tokens)
    assert reply.usage.output_tokens == sum(t not in oracle.tokenizer.eos_token_ids for t in ids)
    assert reply.status == ("completed" if ids[-1] in oracle.tokenizer.eos_token_ids else "incomplete")
    # Streamed: the same text in deltas, the same response at the end.
    events = list(live.client.responses.create(model="tiny", instructions="Be brief.", input=question, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" if reply.status == "completed" else "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    assert events[-1].response.output_text == reply.output_text
    assert events[-1].response.usage.input_tokens_details.cached_tokens == len(tokens) - 1


def test_stored_responses_are_fetched_and_deleted(live):
    reply = live.client.responses.create(model="tiny", input="Hello", max_output_tokens=3)
    fetched = live.client.responses.retrieve(reply.id)
    assert fetched.id == reply.id and fetched.output_text == reply.output_text
    live.client.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        live.client.responses.retrieve(reply.id)
    unstored = live.client.responses.create(model="tiny", input="Hello", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        live.client.responses.retrieve(unstored.id)


@pytest.fixture
def scripted():
    servers = []

    def start(pieces, **options):
        served = scripted_server(pieces, **options)
        served.client = openai.OpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0, timeout=60)
        servers.append(served)
        return served

    yield start
    for served in servers:
        served.stop()


def tool_call_pieces(thinking: bool) -> list[str]:
    reasoning = ["Paris: ", "ask the tool.", "</think>"] if thinking else []
    return reasoning + ["Let me ", "check.", "\n\n"] + [CALL_TEXT[i:i + 9] for i in range(0, len(CALL_TEXT), 9)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("thinking", [False, True])
def test_tool_call_and_its_output_continue_the_conversation(scripted, stream, thinking):
    pieces = tool_call_pieces(thinking)
    served = scripted(pieces)
    client, engine = served.client, served.engine
    reasoning = {"effort": "high"} if thinking else {"effort": "none"}
    if stream:
        events = list(client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER],
                                              reasoning=reasoning, stream=True))
        reply = events[-1].response
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        assert added == (["reasoning"] if thinking else []) + ["message", "function_call"]
    else:
        reply = client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER], reasoning=reasoning)
    mode = "thinking" if thinking else "chat"
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first_prompt = encode_messages(messages, mode, tools=[AS_CHAT_TOOL], reasoning_effort="high")
    assert engine.prefilled[-1] == first_prompt
    calls = [item for item in reply.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 2})]
    assert reply.output_text == "Let me check."
    if thinking:
        assert reply.output[0].type == "reasoning" and reply.output[0].content[0].text == "Paris: ask the tool."

    # The next turn by previous_response_id, and the same by sending the output items back.
    by_id = client.responses.create(model="m", previous_response_id=reply.id, tools=[WEATHER], reasoning=reasoning,
                                    input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                            "output": "sunny, 24 C"}])
    expected = messages + [
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Paris: ask the tool." if thinking else "",
         "tool_calls": [{"id": calls[0].call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny, 24 C"}]
    assert engine.prefilled[-1] == encode_messages(expected, mode, tools=[AS_CHAT_TOOL], reasoning_effort="high")
    # The first answer went back as the pieces the engine generated: all of it was cached.
    assert by_id.usage.input_tokens_details.cached_tokens == len(first_prompt.encode()) + len(pieces)
    echoed = [item.model_dump(exclude_none=True) for item in reply.output]
    stateless = client.responses.create(model="m", store=False, tools=[WEATHER], reasoning=reasoning, input=[
        {"role": "user", "content": "Weather in Paris?"}, *echoed,
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 24 C"}])
    assert engine.prefilled[-1] == engine.prefilled[-2]
    assert stateless.usage.input_tokens_details.cached_tokens == by_id.usage.input_tokens - 1


def test_reasoning_comes_back_from_its_encrypted_content(scripted):
    served = scripted(["I think.", "</think>", "Done."])
    first = served.client.responses.create(model="m", input="Go", reasoning={"effort": "high"}, store=False,
                                           tools=[WEATHER], include=["reasoning.encrypted_content"])
    reasoning = first.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    sealed = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
    served.client.responses.create(model="m", reasoning={"effort": "high"}, tools=[WEATHER], input=[
        {"role": "user", "content": "Go"}, sealed, first.output[1].model_dump(exclude_none=True),
        {"role": "user", "content": "Again"}])
    assert "I think.</think>Done." in served.engine.prefilled[-1]


@pytest.mark.parametrize("body, status, message, param", [
    ({"input": []}, 400, "'input' is empty", "input"),
    ({"input": 3}, 400, "'input' must be a string or a list", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "reads text only", "input"),
    ({"input": [{"type": "web_search_call"}]}, 400, "items of type 'web_search_call' are not supported", "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "only function and custom tools are supported", "tools"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice", "tool_choice"),
    ({"input": "x", "previous_response_id": "resp_nothing"}, 400, "no response with id 'resp_nothing'",
     "previous_response_id"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort must be one of", "reasoning.effort"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, 400, "needs a 'schema'", "text.format"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens=0: expected an integer >= 1",
     "max_output_tokens"),
    ({"input": "x", "temperature": -1}, 400, "temperature=-1", "temperature"),
    ({"input": "x", "background": True}, 400, "background responses are not supported", "background"),
    ({"input": "x", "top_logprobs": 3}, 400, "top_logprobs are not supported", "top_logprobs"),
    ({"input": "word " * 400}, 400, "context is 300 tokens", "input"),
])
def test_bad_requests_get_openai_errors(live, body, status, message, param):
    code, reply = post_raw(live.host, live.port, "/v1/responses", json.dumps(body).encode())
    assert code == status, reply
    assert message in reply["error"]["message"] and reply["error"]["param"] == param
    assert reply["error"]["type"] == "invalid_request_error"


def test_the_client_raises_on_a_bad_request(live):
    with pytest.raises(openai.BadRequestError) as error:
        live.client.responses.create(model="tiny", input="x", max_output_tokens=0)
    assert error.value.param == "max_output_tokens"
    assert get_json(live.host, live.port, "/v1/responses/resp_nothing")[0] == 404


PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
         "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'}}
PATCH_CALL = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="apply_patch">\n'
              '<｜DSML｜ parameter name="input" string="true">*** Begin Patch\n+x = 1\n*** End Patch</｜DSML｜ parameter>\n'
              '</｜DSML｜ invoke>\n</｜DSML｜ calls>')


@pytest.mark.parametrize("stream", [False, True])
def test_custom_tools_are_called_with_free_text(scripted, stream):
    pieces = ["Patching.", "\n\n"] + [PATCH_CALL[i:i + 9] for i in range(0, len(PATCH_CALL), 9)]
    served = scripted(pieces)
    client, engine = served.client, served.engine
    request = dict(model="m", input="Set x.", tools=[PATCH], reasoning={"effort": "none"})
    if stream:
        events = list(client.responses.create(stream=True, **request))
        reply = events[-1].response
        done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
        assert [e.input for e in done] == ["*** Begin Patch\n+x = 1\n*** End Patch"]
    else:
        reply = client.responses.create(**request)
    shown = {"type": "function", "function": {
        "name": "apply_patch", "description": 'Apply a patch.\n\nThe input follows this lark grammar:\n'
                                              'start: "*** Begin Patch" /(.|\\n)*/',
        "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}}
    messages = [{"role": "user", "content": "Set x."}]
    first_prompt = encode_messages(messages, tools=[shown])
    assert engine.prefilled[-1] == first_prompt
    call = reply.output[-1]
    assert (call.type, call.name, call.input) == ("custom_tool_call", "apply_patch",
                                                  "*** Begin Patch\n+x = 1\n*** End Patch")
    echoed = [item.model_dump(exclude_none=True) for item in reply.output]
    again = client.responses.create(model="m", store=False, tools=[PATCH], reasoning={"effort": "none"}, input=[
        *messages, *echoed, {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "done"}])
    expected = messages + [
        {"role": "assistant", "content": "Patching.", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "apply_patch", "arguments": json.dumps({"input": call.input})}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "done"}]
    assert engine.prefilled[-1] == encode_messages(expected, tools=[shown])
    assert again.usage.input_tokens_details.cached_tokens == len(first_prompt.encode()) + len(pieces)
