"""dsv4.encoding renders exactly what DeepSeek's own V4.1 encoder renders.

The oracle is tests/fixtures/encoding/encode_cases.json: prompts produced by the official
encoder (see the README there for its provenance)."""

import copy
import json
from pathlib import Path

import pytest

from dsv4.encoding import encode_messages

FIXTURES = Path(__file__).parent / "fixtures" / "encoding"
CASES = json.loads((FIXTURES / "encode_cases.json").read_text(encoding="utf-8"))["cases"]


def case(name):
    return copy.deepcopy(next(c for c in CASES if c["name"] == name))


@pytest.mark.parametrize("fixture", CASES, ids=[c["name"] for c in CASES])
def test_matches_official_encoder(fixture):
    messages = copy.deepcopy(fixture["messages"])
    assert encode_messages(messages, **fixture["options"]) == fixture["prompt"]
    assert messages == fixture["messages"], "the encoder must not modify its input"


def test_fixture_set_is_varied():
    prompts = {c["name"]: c["prompt"] for c in CASES}
    assert len(CASES) >= 40
    assert sum("<｜DSML｜ calls>" in p for p in prompts.values()) >= 8
    assert sum("<tool_result>" in p for p in prompts.values()) >= 6
    assert sum(p.endswith("<think>") for p in prompts.values()) >= 10
    assert sum(p.endswith("</think>") for p in prompts.values()) >= 10


def test_tools_argument_equals_tools_on_the_system_message():
    with_system = case("tool_round_trip_chat")
    tools = with_system["messages"][0].pop("tools")
    assert encode_messages(with_system["messages"], "chat", tools=tools) == with_system["prompt"]

    no_system = case("empty_system_with_tools_thinking")
    tools = no_system["messages"][0]["tools"]
    rest = no_system["messages"][1:]
    assert encode_messages(rest, "thinking", tools=tools) == no_system["prompt"]


def test_response_format_argument_equals_the_system_field():
    fixture = case("response_format")
    response_format = fixture["messages"][0].pop("response_format")
    assert encode_messages(fixture["messages"], "chat", response_format=response_format) == fixture["prompt"]


def test_earlier_reasoning_is_dropped_but_the_latest_kept():
    prompt = case("multi_turn_thinking")["prompt"]
    assert "Any colour will do." not in prompt and "Not blue again." not in prompt
    kept = case("tool_round_trip_thinking")["prompt"]
    assert "I should call the tool." in kept and "Report it." in kept


@pytest.mark.parametrize("messages, options, message", [
    ([{"role": "user", "content": "x"}], {"thinking_mode": "fast"}, "thinking_mode='fast'"),
    ([{"role": "user", "content": "x"}], {"reasoning_effort": 0}, "reasoning_effort=0"),
    ([{"role": "user", "content": "x"}], {"reasoning_effort": "medium"}, "reasoning_effort='medium'"),
    ([{"role": "user", "content": "x"}], {"reasoning_effort": True}, "reasoning_effort=True"),
    ([{"role": "bot", "content": "x"}], {}, "messages[0]: unsupported role 'bot'"),
    (["just a string"], {}, "messages[0]: expected an object"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]}], {},
     "messages[0]: content part 0 is an image"),
    ([{"role": "user", "content": ["plain"]}], {}, "messages[0]: content part 0 must be an object"),
    ([{"role": "system", "content": "", "tools": [{"name": "f"}]}, {"role": "user", "content": "x"}], {},
     "messages[0].tools[0]: expected {'type': 'function'"),
    ([{"role": "user", "content": "x", "task": "query"}], {}, "messages[0]: 'task'"),
    ([{"role": "user", "content": 42}], {}, "messages[0].content: expected a string, a list of content parts"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}], {},
     "messages[1].tool_calls[0]: expected {'function'"),
    ([{"role": "assistant", "content": "", "tool_calls": {"function": {}}}], {},
     "messages[0].tool_calls: expected a list"),
])
def test_bad_input_is_named(messages, options, message):
    with pytest.raises(ValueError) as error:
        encode_messages(messages, **options)
    assert message in str(error.value)
