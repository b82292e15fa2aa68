"""tool_choice: whether the model may, must or must not call a tool, and which.

Each dialect spells it its own way (OpenAI chat: "auto" | "none" | "required" | {type: function,
function: {name}}; Responses: the same with {type: function | custom, name}; Anthropic: {type:
auto | any | tool (name) | none}); `Choice` is what they mean. The tools stay in the prompt
whatever the choice, so that an agent switching tool_choice between turns keeps its prefix cache;
what the choice changes is a grammar (llguidance, as structured.py runs it) over the answer, after
the reasoning in thinking mode:

- required (Anthropic's any) and a named tool: the answer is a DSML calls block, exactly as
  dsv4.encoding renders one ("\\n\\n" then the block, then end of sentence), each invoke of an
  allowed tool, its parameters those of the tool's JSON schema in schema order (the required ones
  always): a string-typed one as DSML's raw text (string="true", its enum if it has one), any
  other as JSON its schema constrains (string="false"). parallel_tool_calls false (Anthropic's
  disable_parallel_tool_use) allows one invoke.
- none: the answer is text that never opens a calls block.
- auto: no grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from ..encoding import CALLS_CLOSE, CALLS_OPEN, INVOKE_CLOSE, INVOKE_OPEN, PARAMETER_CLOSE, PARAMETER_OPEN
from .errors import RequestError


@dataclass(frozen=True)
class Choice:
    mode: str = "auto"              # "auto", "none" or "required"
    name: Optional[str] = None      # required: the one tool to call (None: any of them)
    parallel: bool = True           # required: more than one call allowed
    param: str = "tool_choice"


def openai_choice(value, param: str = "tool_choice", parallel=None, named_types=("function",)) -> Choice:
    """OpenAI's tool_choice (chat; the Responses API passes its named types: function, custom)."""
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    if value is None or value in ("auto", "none", "required"):
        return Choice(value or "auto", None, parallel, param)
    if isinstance(value, dict) and value.get("type") in named_types:
        name = value.get("name") if "function" not in value else (value.get("function") or {}).get("name")
        if isinstance(name, str):
            return Choice("required", name, parallel, param)
    raise RequestError(f"'{param}' must be auto, none, required or {{type: {'|'.join(named_types)}, name}} "
                       f"naming a tool; got {json.dumps(value)}", param=param)


def anthropic_choice(value) -> Choice:
    """Anthropic's tool_choice: {type: auto | any | tool, name | none, disable_parallel_tool_use}."""
    if value is None:
        return Choice()
    kind = value.get("type") if isinstance(value, dict) else None
    single = value.get("disable_parallel_tool_use", False) if isinstance(value, dict) else False
    if kind not in ("auto", "any", "tool", "none") or not isinstance(single, bool) or \
            (kind == "tool" and not isinstance(value.get("name"), str)):
        raise RequestError("tool_choice must be {type: auto | any | none} or {type: tool, name}; got "
                           f"{json.dumps(value)}", param="tool_choice")
    mode = {"any": "required", "tool": "required"}.get(kind, kind)
    return Choice(mode, value.get("name") if kind == "tool" else None, not single)


def required_functions(choice: Choice, tools: Optional[list]) -> Optional[list]:
    """The functions (encoding's {name, description, parameters}) one of which must be called,
    None when no call is required; a 400 when the choice names no tool the request has."""
    if choice.mode != "required":
        return None
    functions = [t["function"] for t in tools or []]
    if choice.name is not None:
        functions = [f for f in functions if f.get("name") == choice.name]
        if not functions:
            raise RequestError(f"{choice.param} names {choice.name!r}, which is not among the tools",
                               param=choice.param)
    if not functions:
        raise RequestError(f"{choice.param} asks for a tool call but the request has no tools", param=choice.param)
    return functions[:1] if choice.name is not None else functions


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _value(key: str, schema: dict, rule: str, rules: list[str]) -> str:
    """The rule for one parameter `key`, "\n" and its tag first, as the encoder writes them
    (added to `rules`)."""
    schema = schema if isinstance(schema, dict) else {}
    enum = schema.get("enum")
    strings = schema.get("type") == "string" or (enum and all(isinstance(e, str) for e in enum))
    head = f'\n{PARAMETER_OPEN} name="{key}" string="{"true" if strings else "false"}">'
    close = _literal(PARAMETER_CLOSE)
    if strings and enum:
        body = "(" + " | ".join(_literal(e) for e in enum) + ") " + close
    elif strings:   # raw text up to the first closing tag: DSML has no escapes
        rules.append(f"{rule}_text[suffix={close}]: /(?s:.*)/")
        body = f"{rule}_text"
    else:
        rules.append(f"{rule}_json: %json {json.dumps(schema)}")
        body = f"{rule}_json {close}"
    rules.append(f"{rule}: {_literal(head)} {body}")
    return rule


def _invoke(function: dict, index: int, rules: list[str]) -> str:
    """The rule of one invoke of `function`: "\n" and its head, each parameter, "\n" and the
    close. Every separator belongs to the literal after it: the lexer cannot take back a
    "\n" it read as the start of a longer literal."""
    schema = function.get("parameters") or {}
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    params = [(_value(key, value, f"p{index}_{n}", rules), key in required)
              for n, (key, value) in enumerate(properties.items())]
    rule = f"invoke{index}"
    head = _literal(f'\n{INVOKE_OPEN} name="{function["name"]}">')
    close, empty = _literal("\n" + INVOKE_CLOSE), _literal("\n\n" + INVOKE_CLOSE)  # no parameters: an empty line
    # Every subset of the parameters in schema order that holds the required ones.
    sequence = " ".join(p if needed else f"{p}?" for p, needed in params)
    if any(needed for _, needed in params):
        body = f"{sequence} {close}"
    elif params:
        first = [" ".join([params[i][0]] + [f"{p}?" for p, _ in params[i + 1:]]) for i in range(len(params))]
        body = f"({empty} | ({' | '.join(first)}) {close})"
    else:
        body = empty
    rules.append(f"{rule}: {head} {body}")
    return rule


def calls_grammar(functions: list, parallel: bool) -> str:
    """The lark grammar of an answer that is one DSML calls block of these functions."""
    rules: list[str] = []
    invoke = " | ".join(_invoke(f, i, rules) for i, f in enumerate(functions))
    top = [f"start: {_literal(chr(10) * 2 + CALLS_OPEN)} invoke{'+' if parallel else ''} "
           f"{_literal(chr(10) + CALLS_CLOSE)}", f"invoke: {invoke}"]
    return "\n".join(top + rules) + "\n"


# Text that never opens a calls block (tool_choice none).
NO_CALLS_GRAMMAR = f"start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*){CALLS_OPEN}(?s:.*)/\n"
