"""DeepSeek V4.1 chat format: messages -> prompt text, and model output -> a message.

V4.1 has no Jinja template; DeepSeek publishes a Python encoder instead. This module
renders exactly what that encoder renders (tests/fixtures/encoding holds its outputs)
and parses the model's output into reasoning, content and tool calls.

Prompt shape (thinking mode; chat mode has no effort line and writes `</think>` where
thinking mode writes `<think>`):

    <｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (...)\\n\\n{system}\\n\\n{tools}
    <｜User｜>{user}<｜Assistant｜><think>{reasoning}</think>{content}\\n\\n{calls}<｜end▁of▁sentence｜>
    <｜User｜><tool_result>{result}</tool_result><｜Assistant｜><think>

Tool calls use V4.1's "spaced" DSML (note the space after `｜DSML｜`):

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML} calls>"
CALLS_CLOSE = f"</{DSML} calls>"
INVOKE_OPEN = f"<{DSML} invoke"
INVOKE_CLOSE = f"</{DSML} invoke>"
PARAMETER_OPEN = f"<{DSML} parameter"
PARAMETER_CLOSE = f"</{DSML} parameter>"
# The encoder separates content from the calls block by a blank line.
CALLS_START = "\n\n" + CALLS_OPEN

REASONING_EFFORTS = {"low": 50, "high": 75, "max": 100}
DEFAULT_REASONING_EFFORT = "high"
THINKING_MODES = ("chat", "thinking")

# The text the model was trained to read; it must match the official encoder byte for byte.
_TOOLS_PREAMBLE = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{CALLS_OPEN}" block like the following:

{CALLS_OPEN}
{INVOKE_OPEN} name="$TOOL_NAME">
{PARAMETER_OPEN} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_CLOSE}
...
{INVOKE_CLOSE}
{INVOKE_OPEN} name="$TOOL_NAME2">
...
{INVOKE_CLOSE}
{CALLS_CLOSE}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_OPEN}), you MUST output your complete reasoning inside {THINK_OPEN}...{THINK_CLOSE} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_CLOSE} with tool calls or final response.

### Available Tool Schemas

"""
_TOOLS_CLOSING = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
_RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
_EFFORT_LINE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

Message = dict[str, Any]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# --- encoding ---------------------------------------------------------------------------


@dataclass
class _Turn:
    """One rendered unit. Consecutive user and tool messages merge into one user turn whose
    blocks are ("text", str) or ("tool_result", call_id, str); other roles keep their
    content as `text`."""
    role: str
    message: Message
    text: str = ""
    blocks: list = field(default_factory=list)

    @property
    def starts_user_turn(self) -> bool:
        # A user turn made only of tool results continues the assistant's work.
        return self.role == "user" and any(kind == "text" for kind, *_ in self.blocks)


def _content_parts(message: Message, where: str, keep_unsupported: bool) -> list[str]:
    """The message's content as a list of texts. A list of OpenAI content parts keeps its
    text parts; other kinds become "[Unsupported kind]" or are left out, as the official
    encoder does for user/tool and for other roles respectively."""
    content = message.get("content")
    if content is None:
        return [""]
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ValueError(f"{where}.content: expected a string, a list of content parts or null, "
                         f"got {type(content).__name__}")
    texts = []
    for n, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ValueError(f"{where}: content part {n} must be an object with a 'type', got {part!r}")
        if part["type"] in ("image", "image_url"):
            raise ValueError(f"{where}: content part {n} is an image; this model reads text only")
        if part["type"] == "text":
            texts.append(part.get("text") or "")
        elif keep_unsupported:
            texts.append(f"[Unsupported {part['type']}]")
    return texts


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise ValueError(f"{where}: expected a list, got {type(calls).__name__}")
    for n, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}[{n}]: expected {{'function': {{'name': ..., 'arguments': ...}}}}, "
                             f"got {call!r}")


def _merge_turns(messages: list[Message]) -> list[_Turn]:
    turns: list[_Turn] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where}: expected an object, got {type(message).__name__}")
        role = message.get("role")
        if "task" in message:
            raise ValueError(f"{where}: 'task' (DeepSeek's internal classification prompts) is not supported")
        if role == "tool":
            result = "\n\n".join(_content_parts(message, where, keep_unsupported=True))
            blocks = [("tool_result", message.get("tool_call_id", ""), result)]
        elif role == "user":
            blocks = [("text", text) for text in _content_parts(message, where, keep_unsupported=True)]
        elif role in ("system", "assistant", "latest_reminder"):
            if message.get("tool_calls"):
                _check_tool_calls(message["tool_calls"], f"{where}.tool_calls")
            text = "\n\n".join(_content_parts(message, where, keep_unsupported=False))
            turns.append(_Turn(role, message, text))
            continue
        else:
            raise ValueError(f"{where}: unsupported role {role!r}; expected system, user, "
                             f"assistant, tool or latest_reminder")
        if turns and turns[-1].role == "user":
            turns[-1].blocks.extend(blocks)
        else:
            turns.append(_Turn("user", message, blocks=blocks))
    _order_tool_results(turns)
    return turns


def _order_tool_results(turns: list[_Turn]) -> None:
    """Put tool results in the order of the calls of the latest assistant message that made
    calls (unknown ids sort first, stably); text blocks keep their places."""
    call_order: dict[str, int] = {}
    for turn in turns:
        calls = turn.message.get("tool_calls") if turn.role == "assistant" else None
        if calls:
            call_order = {c.get("id"): n for n, c in enumerate(calls) if c.get("id")}
        elif turn.role == "user":
            slots = [n for n, block in enumerate(turn.blocks) if block[0] == "tool_result"]
            ordered = sorted((turn.blocks[n] for n in slots), key=lambda b: call_order.get(b[1], 0))
            for n, block in zip(slots, ordered):
                turn.blocks[n] = block


def _function_of(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        raise ValueError(f"{where}: expected {{'type': 'function', 'function': {{...}}}}, got {tool!r}")
    return tool["function"]


def _render_tools(tools: list, where: str) -> str:
    schemas = "\n".join(_json(_function_of(t, f"{where}[{n}]")) for n, t in enumerate(tools))
    return _TOOLS_PREAMBLE + schemas + _TOOLS_CLOSING


def _arguments_dict(arguments: Any) -> dict:
    """Tool-call arguments as the encoder writes them: a dict, a JSON object string (even
    one encoded twice), or anything else wrapped as {"arguments": raw}."""
    value = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    return value if isinstance(value, dict) else {"arguments": arguments}


def _render_tool_calls(calls: Iterable[dict]) -> str:
    """The DSML block for OpenAI-format tool calls ({"function": {"name", "arguments"}})."""
    invokes = []
    for call in calls:
        function = call["function"]
        parameters = [
            f'{PARAMETER_OPEN} name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f'{value if isinstance(value, str) else _json(value)}{PARAMETER_CLOSE}'
            for key, value in _arguments_dict(function.get("arguments", {})).items()]
        invokes.append(f'{INVOKE_OPEN} name="{function["name"]}">\n' + "\n".join(parameters)
                       + f"\n{INVOKE_CLOSE}")
    return f"{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


def _effort_value(effort: Union[str, int, None]) -> int:
    effort = DEFAULT_REASONING_EFFORT if effort is None else effort
    if type(effort) is int and 1 <= effort <= 100:
        return effort
    if isinstance(effort, str) and effort in REASONING_EFFORTS:
        return REASONING_EFFORTS[effort]
    raise ValueError(f"reasoning_effort={effort!r}: expected an integer 1..100 or one of "
                     f"{sorted(REASONING_EFFORTS)}")


def encode_messages(messages: list[Message], thinking_mode: str = "chat", *,
                    tools: Optional[list] = None, response_format: Optional[dict] = None,
                    reasoning_effort: Union[str, int, None] = None, drop_thinking: bool = True,
                    add_default_bos_token: bool = True) -> str:
    """Render OpenAI-style messages as DeepSeek V4.1's prompt text, ready for the model
    to continue (it ends with the assistant header unless the last message is the
    assistant's).

    thinking_mode: "chat" or "thinking". reasoning_effort: 1..100 or low/high/max, shown
    in thinking mode only. drop_thinking: earlier turns lose their reasoning (kept anyway
    when tools are defined, as the official encoder does). tools / response_format: put
    on the leading system message (an empty one is added if there is none); the official
    encoder reads them only from system messages, where they may also be given directly.
    """
    return "".join(segment.text for segment in encode_segments(
        messages, thinking_mode, tools=tools, response_format=response_format,
        reasoning_effort=reasoning_effort, drop_thinking=drop_thinking,
        add_default_bos_token=add_default_bos_token))


@dataclass(frozen=True)
class Segment:
    """A piece of a rendered prompt. `output` marks what an assistant turn says (its text
    between the assistant header and end of sentence): what the model wrote when it made that
    turn, so a server can put the tokens it generated there instead of re-tokenizing the text."""
    text: str
    output: bool = False


def encode_segments(messages: list[Message], thinking_mode: str = "chat", *,
                    tools: Optional[list] = None, response_format: Optional[dict] = None,
                    reasoning_effort: Union[str, int, None] = None, drop_thinking: bool = True,
                    add_default_bos_token: bool = True) -> list[Segment]:
    """`encode_messages`' prompt as segments (their texts joined are that prompt). Each
    segment boundary next to an output is a special token (the assistant header's think
    marker before it, end of sentence after it), where a tokenizer splits anyway."""
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode={thinking_mode!r}: expected one of {THINKING_MODES}")
    effort = _effort_value(reasoning_effort)
    if tools or response_format:
        messages = _with_system_extras(messages, tools, response_format)
    turns = _merge_turns(messages)
    thinking = thinking_mode == "thinking"
    keep_all_reasoning = not drop_thinking or any(m.get("tools") for m in messages)
    # The latest user turn; a mid-conversation system message counts as one.
    last_user = max((i for i, t in enumerate(turns)
                     if t.starts_user_turn or (t.role == "system" and i > 0)), default=-1)

    out = [Segment(BOS)] if add_default_bos_token else []
    for i, turn in enumerate(turns):
        if i == 0 and (thinking or turn.role == "system"):
            out.append(Segment(SYSTEM))
            if thinking:
                out.append(Segment(_EFFORT_LINE.format(effort)))
        show_reasoning = thinking and (keep_all_reasoning or i > last_user)
        if turn.role == "assistant":
            out += [Segment(render_output(turn.message, show_reasoning), output=True), Segment(EOS)]
        else:
            out.append(Segment(_render_turn(turn, i)))
        following = turns[i + 1].role if i + 1 < len(turns) else None
        if following in (None, "assistant", "latest_reminder") and (
                turn.role == "user" or (turn.role == "system" and i > 0)):
            open_thinking = thinking and (keep_all_reasoning or i >= last_user)
            out.append(Segment(ASSISTANT + (THINK_OPEN if open_thinking else THINK_CLOSE)))
    return out


def _with_system_extras(messages: list[Message], tools, response_format) -> list[Message]:
    messages = list(messages)
    if messages and messages[0].get("role") == "system":
        system = dict(messages[0])
    else:
        system = {"role": "system", "content": ""}
        messages.insert(0, system)
    if tools:
        system["tools"] = tools
    if response_format:
        system["response_format"] = response_format
    messages[0] = system
    return messages


def _render_turn(turn: _Turn, index: int) -> str:
    """A system, user or latest_reminder turn (assistant turns: render_output)."""
    message = turn.message
    if turn.role == "system":
        text = (SYSTEM if index > 0 else "") + turn.text
        if message.get("tools"):
            text += "\n\n" + _render_tools(message["tools"], f"messages[{index}].tools")
        if message.get("response_format"):
            text += "\n\n" + _RESPONSE_FORMAT + _json(message["response_format"])
        return text
    if turn.role == "user":
        return USER + "\n\n".join(
            block[1] if block[0] == "text" else f"<tool_result>{block[2]}</tool_result>"
            for block in turn.blocks)
    return LATEST_REMINDER + turn.text


def render_output(message: Message, show_reasoning: bool) -> str:
    """What an assistant message says as the prompt renders it (after the assistant header,
    before end of sentence): [reasoning</think>]content[\n\n<calls block>]."""
    reasoning = (message.get("reasoning_content") or "") + THINK_CLOSE if show_reasoning else ""
    text = "\n\n".join(_content_parts(message, "assistant message", keep_unsupported=False))
    calls = message.get("tool_calls")
    calls_text = "\n\n" + _render_tool_calls(calls) if calls else ""
    return reasoning + text + calls_text


# --- parsing the model's output -----------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object


@dataclass
class AssistantMessage:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, delta: "Delta") -> None:
        """Append one parser delta to the field it belongs to."""
        if delta.kind == "tool_call":
            self.tool_calls.append(delta.tool_call)
        elif delta.kind == "reasoning":
            self.reasoning += delta.text
        else:
            self.content += delta.text


_INVOKE_HEAD = re.compile(r'\s*name="([^"]+)"\s*>')
_PARAMETER_HEAD = re.compile(r'\s*name="([^"]+)"\s+string="(true|false)"\s*>')


def parse_tool_calls(block: str) -> Optional[list[ToolCall]]:
    """The calls of one complete `<｜DSML｜ calls>...</｜DSML｜ calls>` block, or None when
    it is malformed (unknown or unclosed tags, missing names, duplicate parameters, a
    non-string value that is not JSON, no invoke at all)."""
    if not (block.startswith(CALLS_OPEN) and block.endswith(CALLS_CLOSE)):
        return None
    body, pos, calls = block[len(CALLS_OPEN):-len(CALLS_CLOSE)], 0, []
    while True:
        pos = _skip_space(body, pos)
        if pos == len(body):
            return calls or None
        if not body.startswith(INVOKE_OPEN, pos):
            return None
        head = _INVOKE_HEAD.match(body, pos + len(INVOKE_OPEN))
        if head is None:
            return None
        name, pos, arguments = head.group(1), head.end(), {}
        while True:
            pos = _skip_space(body, pos)
            if body.startswith(INVOKE_CLOSE, pos):
                pos += len(INVOKE_CLOSE)
                break
            if not body.startswith(PARAMETER_OPEN, pos):
                return None
            head = _PARAMETER_HEAD.match(body, pos + len(PARAMETER_OPEN))
            end = body.find(PARAMETER_CLOSE, head.end()) if head else -1
            if end < 0 or head.group(1) in arguments:
                return None
            raw = body[head.end():end]
            if PARAMETER_OPEN in raw or INVOKE_OPEN in raw:  # an earlier tag was never closed
                return None
            if head.group(2) == "true":
                arguments[head.group(1)] = raw
            else:
                try:
                    arguments[head.group(1)] = json.loads(raw)
                except ValueError:
                    return None
            pos = end + len(PARAMETER_CLOSE)
        calls.append(ToolCall(name, _json(arguments)))


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


@dataclass(frozen=True)
class Delta:
    """A piece of parsed output: kind is "reasoning", "content" or "tool_call"."""
    kind: str
    text: str = ""
    tool_call: Optional[ToolCall] = None


class StreamParser:
    """Turns model output, fed in arbitrary pieces, into reasoning/content/tool-call deltas.

    Text that might be the start of a marker (`</think>`, a calls block, end of sentence)
    is held back until it is decided, so no delta ever has to be taken back. A calls
    block is released as tool calls when it closes, or as plain content when it is
    malformed or never closes. Never raises on any input.
    """

    def __init__(self, thinking_mode: str = "chat"):
        if thinking_mode not in THINKING_MODES:
            raise ValueError(f"thinking_mode={thinking_mode!r}: expected one of {THINKING_MODES}")
        self._state = "reasoning" if thinking_mode == "thinking" else "content"
        self._pending = ""
        self._calls_separator = ""

    @property
    def reasoning(self) -> bool:
        """Whether the output is still in its reasoning (before `</think>`)."""
        return self._state == "reasoning"

    def feed(self, text: str) -> list[Delta]:
        self._pending += text
        return self._drain(final=False)

    def close(self) -> list[Delta]:
        """Flush what is held back; the output has ended."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while self._state != "done" and self._step(out, final):
            pass
        merged: list[Delta] = []
        for delta in out:
            if delta.kind != "tool_call" and merged and merged[-1].kind == delta.kind:
                merged[-1] = Delta(delta.kind, merged[-1].text + delta.text)
            elif delta.kind == "tool_call" or delta.text:
                merged.append(delta)
        return merged

    def _step(self, out: list[Delta], final: bool) -> bool:
        """Consume what can be decided now; True when another step may make progress."""
        text = self._pending
        if self._state == "calls":
            close, eos = text.find(CALLS_CLOSE), text.find(EOS)
            if close >= 0 and (eos < 0 or close < eos):
                block, self._pending = text[:close + len(CALLS_CLOSE)], text[close + len(CALLS_CLOSE):]
                calls = parse_tool_calls(block)
                if calls is None:
                    out.append(Delta("content", self._calls_separator + block))
                else:
                    out.extend(Delta("tool_call", tool_call=call) for call in calls)
                self._state = "content"
                return True
            if eos >= 0 or final:
                out.append(Delta("content", self._calls_separator + text[:eos if eos >= 0 else len(text)]))
                self._pending, self._state = "", "done"
            return False

        markers = (THINK_CLOSE, CALLS_OPEN, EOS) if self._state == "reasoning" else (CALLS_OPEN, EOS)
        found = [(text.find(m), m) for m in markers if m in text]
        if not found:
            held = 0 if final else longest_marker_prefix(text, markers + (CALLS_START,))
            out.append(Delta(self._state, text[:len(text) - held]))
            self._pending = text[len(text) - held:]
            return False
        pos, marker = min(found)
        before = text[:pos]
        if marker == CALLS_OPEN:
            self._calls_separator = "\n\n" if before.endswith("\n\n") else ""
            out.append(Delta(self._state, before[:len(before) - len(self._calls_separator)]))
            self._pending, self._state = text[pos:], "calls"
            return True
        out.append(Delta(self._state, before))
        self._pending = text[pos + len(marker):]
        self._state = "content" if marker == THINK_CLOSE else "done"
        return marker == THINK_CLOSE


def longest_marker_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could be the beginning of one of the markers
    (the part a streaming reader must hold back until more text decides it)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest


def parse_completion(text: str, thinking_mode: str = "chat") -> AssistantMessage:
    """The whole output of one generation (the text after the prompt) as a message."""
    parser = StreamParser(thinking_mode)
    message = AssistantMessage()
    for delta in parser.feed(text) + parser.close():
        message.add(delta)
    return message
