"""tool_choice on chat, Responses and Messages, enforced by a grammar: the grammar of a required
call accepts exactly what dsv4.encoding renders for valid arguments (the encoder is the oracle)
and refuses arguments its schema does not allow; through the real openai and anthropic clients,
the tiny random checkpoint sampled at temperature 1 under required / any / a named tool always
answers with a call whose arguments validate (jsonschema), and a scripted model's call is
refused under none, its text passed through under auto."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
from llguidance import LLMatcher  # noqa: E402

from dsv4.encoding import CALLS_OPEN, _render_tool_calls, parse_tool_calls  # noqa: E402
from dsv4.serve.tool_choice import NO_CALLS_GRAMMAR, calls_grammar  # noqa: E402
from tests.server_helpers import ScriptedEngine, clients_server, in_parallel, post_raw, scripted_server  # noqa: E402

# Parameters a random model ends (enums, booleans, bounded integers), and a free-text one.
SETTINGS = {"type": "object", "properties": {
    "mode": {"enum": ["fast", "slow"]}, "on": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["mode", "on"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"]}
NOTE = {"type": "object", "properties": {"text": {"type": "string"}, "pinned": {"type": "boolean"}}}
FUNCTIONS = [{"name": "configure", "description": "Set the mode.", "parameters": SETTINGS},
             {"name": "clock", "description": "The time.", "parameters": CLOCK}]
TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]
SCHEMAS = {f["name"]: f["parameters"] for f in FUNCTIONS}
QUESTION = [{"role": "user", "content": "Set things up."}]


def matcher(grammar: str):
    tokenizer = ScriptedEngine([]).constraint_tokenizer()   # byte ids: the grammar sees every byte
    compiled = LLMatcher.grammar_from_lark(grammar)
    assert not LLMatcher.validate_grammar_with_warnings(compiled, tokenizer)[0]
    return LLMatcher(tokenizer, compiled)


def accepts(grammar: str, text: str) -> bool:
    m = matcher(grammar)
    return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()


def rendered(*calls) -> str:
    """An answer that is only these calls, as the encoder renders an assistant message."""
    return "\n\n" + _render_tool_calls([{"function": {"name": n, "arguments": a}} for n, a in calls])


VALID = [[("configure", {"mode": "fast", "on": True})], [("configure", {"mode": "slow", "on": False, "level": 42})],
         [("clock", {"zone": "utc"}), ("configure", {"mode": "fast", "on": False, "level": 0})],
         [("note", {"text": "a <b> & \"c\"\nd", "pinned": True})], [("note", {"pinned": False})], [("note", {})]]
INVALID = [[("configure", {"on": True})],                          # a required parameter missing
           [("configure", {"mode": "medium", "on": True})],        # not in the enum
           [("configure", {"mode": "fast", "on": True, "level": 100})],   # out of bounds
           [("configure", {"on": True, "mode": "fast"})],          # not in schema order
           [("configure", {"mode": "fast", "on": "yes"})],         # not a boolean
           [("other", {})]]                                        # not a tool


@pytest.mark.parametrize("calls", VALID)
def test_a_required_call_takes_what_the_encoder_renders(calls):
    grammar = calls_grammar(FUNCTIONS + [{"name": "note", "parameters": NOTE}], parallel=True)
    text = rendered(*calls)
    assert accepts(grammar, text)
    parsed = parse_tool_calls(text.strip())
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls


@pytest.mark.parametrize("calls", INVALID)
def test_a_required_call_refuses_what_its_schema_does_not_allow(calls):
    assert not accepts(calls_grammar(FUNCTIONS, parallel=True), rendered(*calls))


def test_named_and_single_calls():
    two = rendered(("clock", {"zone": "utc"}), ("clock", {"zone": "local"}))
    assert accepts(calls_grammar(FUNCTIONS[1:], parallel=True), two)
    assert not accepts(calls_grammar(FUNCTIONS[1:], parallel=False), two)
    assert not accepts(calls_grammar(FUNCTIONS[1:], parallel=False), rendered(("configure", {"mode": "fast", "on": True})))
    assert not accepts(calls_grammar(FUNCTIONS, parallel=True), "Sure." + rendered(("clock", {"zone": "utc"})))


def test_none_refuses_a_calls_block_only():
    assert accepts(NO_CALLS_GRAMMAR, "Plain text, even <｜DSML｜ invoke, is fine.")
    assert not accepts(NO_CALLS_GRAMMAR, "Sure." + rendered(("clock", {"zone": "utc"})))


# --- through the real clients on the tiny random checkpoint ------------------------------------

@pytest.fixture(scope="module")
def served(tiny_dir):
    served = clients_server(tiny_dir, max_sessions=8, max_context=4096)
    yield served
    served.stop()


def check_calls(calls: list[tuple[str, dict]], names: set[str]):
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(arguments, SCHEMAS[name])


def test_required_and_named_calls_validate_on_every_api(served):
    """One batch (a call is ~280 tokens of the tiny checkpoint's vocabulary, decoded together)."""
    chat = lambda choice, seed, most=400: served.openai.chat.completions.create(
        model="tiny", messages=QUESTION, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed, max_tokens=most)
    respond = lambda: served.openai.responses.create(
        model="tiny", input="Set things up.", tools=[{"type": "function", **f} for f in FUNCTIONS],
        tool_choice={"type": "function", "name": "configure"}, temperature=1.0, max_output_tokens=400,
        parallel_tool_calls=False)
    message = lambda choice: served.anthropic.messages.create(
        model="tiny", max_tokens=400, messages=QUESTION, tool_choice=choice, extra_body={"temperature": 1.0},
        tools=[{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
               for f in FUNCTIONS])
    asks = [lambda: chat("required", 1), lambda: chat({"type": "function", "function": {"name": "clock"}}, 2),
            respond, lambda: message({"type": "any", "disable_parallel_tool_use": True}),
            lambda: chat("auto", 3, 40)]
    required, named, response, anthropic_reply, free = in_parallel(lambda ask: ask(), asks)
    for reply, names in ((required, {"configure", "clock"}), (named, {"clock"})):
        assert reply.choices[0].finish_reason == "tool_calls"
        check_calls([(c.function.name, json.loads(c.function.arguments))
                     for c in reply.choices[0].message.tool_calls], names)
    calls = [i for i in response.output if i.type == "function_call"]
    assert len(calls) == 1
    check_calls([(c.name, json.loads(c.arguments)) for c in calls], {"configure"})
    assert anthropic_reply.stop_reason == "tool_use"
    uses = [b for b in anthropic_reply.content if b.type == "tool_use"]
    assert len(uses) == 1
    check_calls([(b.name, b.input) for b in uses], {"configure", "clock"})
    assert not free.choices[0].message.tool_calls   # unconstrained, the random model calls nothing


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": QUESTION, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": QUESTION, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nothing"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": QUESTION, "tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": QUESTION, "tools": TOOLS, "parallel_tool_calls": 1},
     "parallel_tool_calls"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", **FUNCTIONS[0]}],
                       "tool_choice": {"type": "function", "name": "clock"}}, "tool_choice"),
    ("/v1/responses", {"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
])
def test_choices_that_cannot_be_met_get_openai_400s(served, path, body, param):
    code, reply = post_raw(served.host, served.port, path, json.dumps(body).encode())
    assert code == 400 and reply["error"]["param"] == param, reply


@pytest.mark.parametrize("choice", [{"type": "tool"}, {"type": "tool", "name": "clock"}, {"type": "sometimes"}])
def test_choices_that_cannot_be_met_get_anthropic_400s(served, choice):
    body = {"max_tokens": 5, "messages": QUESTION, "tool_choice": choice}
    code, reply = post_raw(served.host, served.port, "/v1/messages", json.dumps(body).encode())
    assert code == 400 and reply["type"] == "error" and "tool_choice" in reply["error"]["message"]


# --- a scripted model: what the grammar does to an answer it would not allow --------------------

CALL = [CALLS_OPEN, "\n", '<｜DSML｜ invoke name="clock">', "\n", '<｜DSML｜ parameter name="zone" string="true">',
        "local", "</｜DSML｜ parameter>", "\n", "</｜DSML｜ invoke>", "\n", "</｜DSML｜ calls>"]


def test_a_scripted_call_is_refused_under_none():
    served = scripted_server(["\n\n", *CALL])
    client = openai.OpenAI(base_url=served.base + "/v1", api_key="x", max_retries=0, timeout=60)
    ask = lambda **kw: client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, max_tokens=400, **kw)
    try:
        auto = ask().choices[0]
        assert auto.finish_reason == "tool_calls" and auto.message.tool_calls[0].function.name == "clock"
        none = ask(tool_choice="none").choices[0]
        assert none.message.tool_calls is None and none.finish_reason == "stop"
        assert CALLS_OPEN not in none.message.content and "invoke" in none.message.content
        # Required: llguidance forces the block's text as the tokenizer spells it (bytes here),
        # so the script falls out of step, and the grammar still ends in a valid call.
        required = ask(tool_choice="required").choices[0]
        assert required.finish_reason == "tool_calls"
        check_calls([(c.function.name, json.loads(c.function.arguments)) for c in required.message.tool_calls],
                    {"configure", "clock"})
    finally:
        served.stop()


def test_a_scripted_answer_becomes_a_call_after_free_thinking():
    served = scripted_server(["Let me", " think.", "</think>", "Sure", "."])
    client = anthropic.Anthropic(base_url=served.base, api_key="x", max_retries=0, timeout=60)
    tools = [{"name": "clock", "input_schema": CLOCK}]
    try:
        message = client.messages.create(model="m", max_tokens=200, messages=QUESTION, tools=tools,
                                         tool_choice={"type": "any"}, thinking={"type": "enabled", "budget_tokens": 100})
        assert [b.type for b in message.content] == ["thinking", "tool_use"]
        assert message.content[0].thinking == "Let me think."
        # The script's words are refused; the grammar's first choice wins: the enum's first value.
        assert (message.content[1].name, message.content[1].input) == ("clock", {"zone": "local"})
        assert message.stop_reason == "tool_use"
    finally:
        served.stop()
