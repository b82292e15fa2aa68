"""Anthropic's Messages API: POST /v1/messages (streaming events or not) and
/v1/messages/count_tokens, with Anthropic's error shape on both.

Messages hold text, tool_use and tool_result blocks and thinking blocks (the reasoning of an
earlier turn); `system` is a string or text blocks; tools are {name, description, input_schema}, tool_choice auto, any, tool (by name) or none, enforced
by a grammar (tool_choice.py).
Thinking is on with `thinking: {type: enabled | adaptive}` (off with disabled; the server's
default otherwise), its effort from `output_config.effort`; a JSON schema in
`output_config.format` constrains the answer. `usage.cache_read_input_tokens` is what the prefix
cache gave and `input_tokens` the rest, as Anthropic counts them.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from . import options as opt
from .service import Service, read_json, sse
from .errors import RequestError
from .output import ClientGone, Generation
from .structured import constraint_for
from .tool_choice import anthropic_choice

PREFIX = "/v1/messages"

SAMPLING = {"temperature": "temp", "top_p": "top_p"}

UNSUPPORTED = {
    "top_k": (lambda v: v is None, "top_k is not supported"),
    "container": (lambda v: v is None, "containers are not supported"),
    "mcp_servers": (lambda v: v in (None, []), "MCP servers are not supported"),
}

# Anthropic's error types by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 411: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}

EFFORTS = {"low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}


def error_body(error: RequestError) -> dict:
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(error)}}


def error_response(error: RequestError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status)


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise RequestError(f"{where}.content must be a string or a list of content blocks", param="messages")
    return content


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        parts = _blocks(content, where)
        for part in parts:
            if part.get("type") != "text":
                raise RequestError(f"{where}: a tool_result holds {part.get('type')!r}; this model reads text only",
                                   param="messages")
        text = "\n\n".join(p.get("text") or "" for p in parts)
    return ("Error: " + text) if block.get("is_error") else text


def conversation(body: dict) -> list[dict]:
    """system and messages as OpenAI chat messages (dsv4.encoding's input)."""
    system = body.get("system")
    out: list[dict] = []
    if system is not None:
        if isinstance(system, list):
            system = "\n\n".join(b.get("text") or "" for b in _blocks(system, "system") if b.get("type") == "text")
        if not isinstance(system, str):
            raise RequestError("'system' must be a string or a list of text blocks", param="system")
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise RequestError(f"{where}: role must be user or assistant, got {role!r}", param="messages")
        blocks = _blocks(message.get("content"), where)
        if role == "user":
            text = []
            for n, block in enumerate(blocks):
                kind = block.get("type")
                if kind == "tool_result":
                    out.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""),
                                "content": _tool_result_text(block, f"{where}.content[{n}]")})
                elif kind == "text":
                    text.append(block.get("text") or "")
                else:
                    raise RequestError(f"{where}.content[{n}] is {kind!r}; this model reads text only",
                                       param="messages")
            if text:
                out.append({"role": "user", "content": "\n\n".join(text)})
            continue
        reply = {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}
        for n, block in enumerate(blocks):
            kind = block.get("type")
            if kind == "text":
                reply["content"] += block.get("text") or ""
            elif kind == "thinking":
                reply["reasoning_content"] += block.get("thinking") or ""
            elif kind == "tool_use":
                reply["tool_calls"].append({"id": block.get("id", ""), "type": "function", "function": {
                    "name": block.get("name", ""), "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind != "redacted_thinking":
                raise RequestError(f"{where}.content[{n}]: unsupported block {kind!r}", param="messages")
        out.append(reply)
    if out[-1]["role"] == "assistant":
        raise RequestError("a last assistant message (a prefill to continue) is not supported", param="messages")
    return out


def tools_of(body: dict) -> Optional[list]:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    out = []
    for n, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or \
                tool.get("type") not in (None, "custom") or not isinstance(tool.get("input_schema"), dict):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise RequestError(f"tools[{n}]: only custom tools with a name and an input_schema are supported "
                               f"(got type {kind!r})", param="tools")
        out.append({"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "",
                                                     "parameters": tool["input_schema"]}})
    return out


def thinking_mode(body: dict, default: bool) -> tuple[str, Optional[str]]:
    thinking = body.get("thinking")
    on = default
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
            raise RequestError("'thinking' must be {type: enabled | adaptive | disabled}", param="thinking")
        on = kind != "disabled"
    config = body.get("output_config") or {}
    if not isinstance(config, dict):
        raise RequestError("'output_config' must be an object", param="output_config")
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise RequestError(f"output_config.effort must be one of {', '.join(EFFORTS)}", param="output_config.effort")
    return ("thinking" if on else "chat"), EFFORTS.get(effort)


def output_format(body: dict) -> Optional[dict]:
    fmt = (body.get("output_config") or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise RequestError("output_config.format must be {type: json_schema, schema: {...}}",
                           param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def prompt_of(body: dict, service: Service) -> opt.Prompt:
    mode, effort = thinking_mode(body, service.thinking)
    return opt.Prompt(conversation(body), mode, tools_of(body), output_format(body), effort,
                      tool_choice=anthropic_choice(body.get("tool_choice")))


def routes(service: Service) -> list[Route]:
    async def create(request: Request):
        return await respond(request, service)

    async def count_tokens(request: Request):
        try:
            body = await read_json(request)
            return JSONResponse({"input_tokens": len(service.tokenize(prompt_of(body, service))[0])})
        except RequestError as error:
            return error_response(error)

    return [Route(PREFIX, create, methods=["POST"]), Route(PREFIX + "/count_tokens", count_tokens, methods=["POST"])]


async def respond(request: Request, service: Service):
    generation = None
    try:
        body = await read_json(request)
        opt.refuse_unsupported(body, UNSUPPORTED)
        prompt = prompt_of(body, service)
        tokens = service.tokenize(prompt)   # ids and the replay records they took
        limits = opt.Limits(opt.max_tokens(body, ("max_tokens",), None),
                            opt.stop_strings(body.get("stop_sequences"), "stop_sequences"),
                            opt.sampling(body, SAMPLING, service.scheduler.vocab_size))
        stream = opt.boolean(body, "stream")
        generation = Generation(service.scheduler, tokens, limits, prompt.mode,
                                constraint_for(prompt, service, "output_config.format"))
        generation.watch(request)
        await generation.start()
    except RequestError as error:
        if generation is not None:
            generation.close()
        return error_response(error)
    except ClientGone:
        generation.close()
        return JSONResponse({})
    answer = Answer(body.get("model") or service.model_name, generation)
    if stream:
        return StreamingResponse(answer.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        async for _ in answer.blocks():
            pass
        return JSONResponse(answer.message())
    except RequestError as error:
        return error_response(error)
    except ClientGone:
        return JSONResponse({})
    finally:
        generation.close()


def signature(thinking: str) -> str:
    """An opaque stand-in for Anthropic's signature (clients send thinking blocks back with it)."""
    return "dsv4-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


class Answer:
    """One message: content blocks built from the generation's deltas, as events or whole."""

    def __init__(self, model: str, generation: Generation):
        self.model, self.generation = model, generation
        self.id = "msg_" + uuid.uuid4().hex
        self.content: list[dict] = []

    def usage(self) -> dict:
        g = self.generation
        return {"input_tokens": g.prompt_tokens - g.cached_tokens, "output_tokens": g.completion_tokens,
                "cache_read_input_tokens": g.cached_tokens, "cache_creation_input_tokens": 0}

    def stop_reason(self) -> Optional[str]:
        g = self.generation
        if g.finish is None:
            return None
        if g.stop_sequence is not None:
            return "stop_sequence"
        return {"length": "max_tokens", "tool_calls": "tool_use"}.get(g.finish, "end_turn")

    def message(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content, "stop_reason": self.stop_reason(),
                "stop_sequence": self.generation.stop_sequence, "usage": self.usage()}

    async def blocks(self):
        """(event name, data) pairs while the content blocks are built from the deltas."""
        current: Optional[dict] = None

        def stop(block: dict):
            if block["type"] == "thinking":
                block["signature"] = signature(block["thinking"])
                yield "content_block_delta", {"type": "content_block_delta", "index": self.content.index(block),
                                              "delta": {"type": "signature_delta", "signature": block["signature"]}}
            yield "content_block_stop", {"type": "content_block_stop", "index": self.content.index(block)}

        async for delta in self.generation.deltas():
            kind = {"reasoning": "thinking", "content": "text"}.get(delta.kind, "tool_use")
            if current is not None and (current["type"] != kind or kind == "tool_use"):
                for event in stop(current):
                    yield event
                current = None
            index = len(self.content)
            if kind == "tool_use":
                call = delta.tool_call
                block = {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": call.name, "input": {}}
                self.content.append(block)
                yield "content_block_start", {"type": "content_block_start", "index": index,
                                              "content_block": dict(block)}
                block["input"] = json.loads(call.arguments)
                yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": {"type": "input_json_delta", "partial_json": call.arguments}}
                for event in stop(block):
                    yield event
                continue
            if current is None:
                current = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                    else {"type": "text", "text": ""}
                self.content.append(current)
                yield "content_block_start", {"type": "content_block_start", "index": index,
                                              "content_block": dict(current)}
            current[kind] += delta.text
            field = "thinking_delta" if kind == "thinking" else "text_delta"
            yield "content_block_delta", {"type": "content_block_delta", "index": self.content.index(current),
                                          "delta": {"type": field, kind: delta.text}}
        if current is not None:
            for event in stop(current):
                yield event

    async def stream(self):
        try:
            start = self.message()
            start["usage"]["output_tokens"] = 0
            yield sse({"type": "message_start", "message": start}, event="message_start")
            yield sse({"type": "ping"}, event="ping")
            async for name, data in self.blocks():
                yield sse(data, event=name)
            yield sse({"type": "message_delta", "delta": {"stop_reason": self.stop_reason(),
                                                          "stop_sequence": self.generation.stop_sequence},
                       "usage": self.usage()}, event="message_delta")
            yield sse({"type": "message_stop"}, event="message_stop")
        except RequestError as error:
            yield sse(error_body(error), event="error")
        except ClientGone:
            return
        finally:
            self.generation.close()
