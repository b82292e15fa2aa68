"""The output parser reads what DeepSeek's own parser reads from well-formed completions, gives
the same result however the text is split while streaming, and turns anything malformed into
plain text instead of failing."""

import json
import random
from pathlib import Path

import pytest

from dsv4.encoding import (AssistantMessage, StreamParser, ToolCall, parse_completion,
                           parse_tool_calls)

FIXTURES = Path(__file__).parent / "fixtures" / "encoding"
CASES = json.loads((FIXTURES / "parse_cases.json").read_text(encoding="utf-8"))["cases"]

CALL = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
        '</｜DSML｜ invoke>\n</｜DSML｜ calls>')
WEATHER = ToolCall("get_weather", '{"city": "Paris", "days": 3}')


def streamed(text, pieces, mode):
    """Parse `text` fed in the given pieces and fold the deltas into a message."""
    parser, message, cuts = StreamParser(mode), AssistantMessage(), [0, *pieces, len(text)]
    deltas = [d for a, b in zip(cuts, cuts[1:]) for d in parser.feed(text[a:b])] + parser.close()
    for delta in deltas:
        if delta.kind == "tool_call":
            message.tool_calls.append(delta.tool_call)
        else:
            setattr(message, delta.kind, getattr(message, delta.kind) + delta.text)
    return message


@pytest.mark.parametrize("fixture", CASES, ids=[c["name"] for c in CASES])
def test_matches_official_parser(fixture):
    message = parse_completion(fixture["completion"], fixture["thinking_mode"])
    expected = fixture["expected"]
    assert message.content == expected["content"]
    assert message.reasoning == expected["reasoning_content"]
    assert [(c.name, c.arguments) for c in message.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in expected["tool_calls"]]


@pytest.mark.parametrize("fixture", CASES, ids=[c["name"] for c in CASES])
def test_any_split_gives_the_same_message(fixture):
    text, mode = fixture["completion"], fixture["thinking_mode"]
    whole = parse_completion(text, mode)
    assert streamed(text, list(range(1, len(text))), mode) == whole  # one character at a time
    for cut in range(len(text) + 1):
        assert streamed(text, [cut], mode) == whole
    rng = random.Random(len(text))
    for _ in range(20):
        assert streamed(text, sorted(rng.sample(range(len(text) + 1), 5)), mode) == whole


def test_fixtures_cover_calls_and_reasoning():
    assert sum(bool(c["expected"]["tool_calls"]) for c in CASES) >= 6
    assert sum(bool(c["expected"]["reasoning_content"]) for c in CASES) >= 4


@pytest.mark.parametrize("mode", ["chat", "thinking"])
def test_every_prefix_parses_without_error(mode):
    """A generation can stop anywhere (max_tokens); a cut calls block comes back as text."""
    text = ("plan" + "</think>" if mode == "thinking" else "") + "Checking.\n\n" + CALL + "<｜end▁of▁sentence｜>"
    for cut in range(len(text) + 1):
        message = parse_completion(text[:cut], mode)
        block_start = text.index("<｜DSML｜ calls>")
        if block_start <= cut < text.index("</｜DSML｜ calls>") + len("</｜DSML｜ calls>"):
            assert message.tool_calls == []
            assert message.content == "Checking.\n\n" + text[block_start:cut]


@pytest.mark.parametrize("block", [
    CALL.replace(' name="get_weather"', ""),                              # invoke without a name
    CALL.replace(' string="true"', ""),                                   # parameter without string=
    CALL.replace('string="false">3', 'string="false">three'),             # non-string value not JSON
    CALL.replace("</｜DSML｜ invoke>", ""),                                 # invoke never closed
    CALL.replace("</｜DSML｜ parameter>\n<", "\n<", 1),                    # parameter never closed
    CALL.replace('name="days"', 'name="city"'),                           # duplicate parameter
    CALL.replace("<｜DSML｜ invoke", "<｜DSML｜invoke"),                    # V4 (unspaced) tag
    CALL.replace("<｜DSML｜ invoke", "<｜DSML｜ call"),                     # unknown tag
    "<｜DSML｜ calls>\n</｜DSML｜ calls>",                                  # no invoke at all
    CALL.replace("</｜DSML｜ invoke>\n", "</｜DSML｜ invoke>\nstray text\n"),  # text between invokes
])
@pytest.mark.parametrize("mode", ["chat", "thinking"])
def test_malformed_calls_come_back_as_text(block, mode):
    head = "r</think>" if mode == "thinking" else ""
    message = parse_completion(head + "Let me see.\n\n" + block + "<｜end▁of▁sentence｜>", mode)
    assert message.tool_calls == []
    assert message.content == "Let me see.\n\n" + block
    assert streamed(head + "Let me see.\n\n" + block, list(range(1, len(head) + 13 + len(block))), mode) == message


def test_unterminated_block_comes_back_as_text():
    text = "Sure.\n\n" + CALL[:-10]
    assert parse_completion(text) == AssistantMessage(content=text)


def test_tool_calls_parse_to_json_arguments():
    assert parse_tool_calls(CALL) == [WEATHER]
    spaced = CALL.replace("\n", "\n  ").replace('">', '" >')
    assert parse_tool_calls(spaced) == [WEATHER]
    two = CALL.replace("</｜DSML｜ calls>", CALL.split("\n", 1)[1])
    assert parse_tool_calls(two) == [WEATHER, WEATHER]
    value = '<｜DSML｜ parameter name="q" string="true">a </｜DSML> b\n\nc</｜DSML｜ parameter>'
    block = CALL.replace('<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>', value)
    assert json.loads(parse_tool_calls(block)[0].arguments) == {"city": "Paris", "q": "a </｜DSML> b\n\nc"}


def test_calls_inside_reasoning_are_recovered():
    """Models sometimes open a calls block before closing their reasoning."""
    message = parse_completion("I need the weather.\n\n" + CALL + "<｜end▁of▁sentence｜>", "thinking")
    assert message == AssistantMessage(reasoning="I need the weather.", tool_calls=[WEATHER])


def test_text_after_calls_and_after_end_of_sentence():
    message = parse_completion("A\n\n" + CALL + "\nB<｜end▁of▁sentence｜>ignored")
    assert message == AssistantMessage(content="A\nB", tool_calls=[WEATHER])
    assert parse_completion("no eos, cut by max_tokens", "thinking") == AssistantMessage(
        reasoning="no eos, cut by max_tokens")


def test_held_back_text_is_released_once_decided():
    parser = StreamParser("chat")
    assert [d.text for d in parser.feed("Hello\n")] == ["Hello"]
    assert [d.text for d in parser.feed("\n<｜DS")] == []
    assert [d.text for d in parser.feed("x")] == ["\n\n<｜DSx"]
    assert parser.close() == []


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="thinking_mode='fast'"):
        StreamParser("fast")
