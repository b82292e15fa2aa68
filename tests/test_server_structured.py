"""Structured output: sampled answers of the tiny random checkpoint under a JSON schema validate
(jsonschema) through chat's response_format, the Responses API's text.format and Anthropic's
output_config.format, decoded 8 at a time; without the constraint they do not; thinking stays
free until `</think>`; schemas that cannot be enforced, and schemas with tools, get 400s."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

from tests.server_helpers import clients_server, in_parallel, post_raw, scripted_server  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "count": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue"]}}},
    "required": ["name", "count", "ok", "tags"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
QUESTION = [{"role": "user", "content": "Describe a record as JSON."}]


@pytest.fixture(scope="module")
def served(tiny_dir):
    served = clients_server(tiny_dir, max_sessions=8, max_context=4096)
    yield served
    served.stop()


def test_chat_answers_sampled_under_a_schema_validate(served):
    ask = lambda seed: served.openai.chat.completions.create(
        model="tiny", messages=QUESTION, response_format=FORMAT, temperature=1.0, seed=seed, max_tokens=300)
    replies = in_parallel(ask, range(24))
    texts = [r.choices[0].message.content for r in replies]
    for reply, text in zip(replies, texts):
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 12   # sampled: they differ
    # The same requests without the constraint: the random model writes no such JSON.
    free = in_parallel(lambda seed: served.openai.chat.completions.create(
        model="tiny", messages=QUESTION, temperature=1.0, seed=seed, max_tokens=60), range(8))
    assert not any(_valid(r.choices[0].message.content) for r in free)


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_json_object_gives_an_object(served):
    replies = in_parallel(lambda seed: served.openai.chat.completions.create(
        model="tiny", messages=QUESTION, response_format={"type": "json_object"}, temperature=1.0, seed=seed,
        max_tokens=100), range(8))
    for reply in replies:
        if reply.choices[0].finish_reason == "stop":   # an object has no size bound: some run long
            assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert sum(r.choices[0].finish_reason == "stop" for r in replies) >= 4


def test_responses_and_messages_answers_validate(served):
    texts = in_parallel(lambda seed: served.openai.responses.create(
        model="tiny", input="Describe a record as JSON.", temperature=1.0, max_output_tokens=300,
        text={"format": {"type": "json_schema", "name": "record", "schema": SCHEMA}}).output_text, range(8))
    texts += in_parallel(lambda seed: served.anthropic.messages.create(
        model="tiny", max_tokens=300, messages=QUESTION, extra_body={"temperature": 1.0},
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}}).content[0].text, range(8))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": QUESTION, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ("/v1/chat/completions", {"messages": QUESTION, "response_format": FORMAT, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "response_format"),
    ("/v1/chat/completions", {"messages": QUESTION, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                                         "schema": {"type": "nonsense"}}}}, "text.format"),
])
def test_schemas_that_cannot_be_enforced_get_400s(served, path, body, param):
    code, reply = post_raw(served.host, served.port, path, json.dumps(body).encode())
    assert code == 400 and reply["error"]["param"] == param, reply


def test_a_bad_format_gets_an_anthropic_error(served):
    body = {"max_tokens": 5, "messages": QUESTION, "output_config": {"format": {"type": "json_schema",
                                                                               "schema": {"type": "nonsense"}}}}
    code, reply = post_raw(served.host, served.port, "/v1/messages", json.dumps(body).encode())
    assert code == 400 and reply["type"] == "error" and "cannot be enforced" in reply["error"]["message"]


def test_thinking_is_free_and_the_answer_obeys():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    served = scripted_server(["Let me", " think.", "</think>", *'{"ok": true}'])
    client = openai.OpenAI(base_url=served.base + "/v1", api_key="x", max_retries=0, timeout=60)
    try:
        thought = client.chat.completions.create(model="m", messages=QUESTION, response_format=fmt,
                                                 extra_body={"thinking": {"type": "enabled"}})
        assert thought.choices[0].message.reasoning_content == "Let me think."
        assert thought.choices[0].message.content == '{"ok": true}'
        # Without thinking the constraint starts at once: the script's words are not JSON, so the
        # grammar's tokens win where the script's are refused.
        plain = client.chat.completions.create(model="m", messages=QUESTION, response_format=fmt)
        assert plain.choices[0].message.content == '{"ok": false}'
    finally:
        served.stop()
