"""OpenAI's Responses API: POST /v1/responses (streaming events or not), GET/DELETE
/v1/responses/{id}.

Input is a string or a list of items: messages (user, system, developer, assistant), function
and custom tool calls and their outputs, reasoning items; `instructions` go first as a system
message. Output items: a reasoning item in thinking mode (its text in `content`, and in
`encrypted_content` for clients that do not store responses: sent back, it is read again), the
message, and one function_call item per tool call (custom_tool_call for a custom tool, which the
model sees as a function of one string parameter `input`, its grammar in the description). A stored response (store is true unless the request says
otherwise) is the conversation `previous_response_id` continues: its input and output, without
its instructions, as OpenAI's API has it.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections import OrderedDict
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from . import options as opt
from .service import Service, openai_error, read_json, sse
from .errors import RequestError
from .output import ClientGone, Generation
from .structured import constraint_for
from .tool_choice import Choice, openai_choice

STORED_RESPONSES = 1024   # responses kept for previous_response_id and GET, least recently made dropped

SAMPLING = {"temperature": "temp", "top_p": "top_p"}

UNSUPPORTED = {
    "background": (lambda v: v in (None, False), "background responses are not supported"),
    "conversation": (lambda v: v is None, "conversations are not supported; use previous_response_id"),
    "prompt": (lambda v: v is None, "prompt templates are not supported"),
    "top_logprobs": (lambda v: v in (None, 0), "top_logprobs are not supported"),
    "max_tool_calls": (lambda v: v is None, "max_tool_calls is not supported"),
}

# OpenAI's reasoning efforts as V4.1's (minimal and xhigh have no level of their own there).
EFFORTS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}


def _text_of(content, where: str) -> str:
    """A message's content (a string or input_text/output_text parts) as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of parts", param="input")
    texts = []
    for n, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            texts.append(part.get("text") or "")
        elif kind in ("input_image", "input_file", "input_audio"):
            raise RequestError(f"{where}.content[{n}] is {kind}; this model reads text only", param="input")
        elif kind != "refusal":
            raise RequestError(f"{where}.content[{n}]: unsupported part {kind!r}", param="input")
    return "".join(texts)


def reasoning_text(item: dict) -> str:
    """The reasoning of a reasoning item: its content, else its encrypted_content as we wrote it."""
    texts = [p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict)]
    if texts:
        return "".join(texts)
    sealed = item.get("encrypted_content")
    if isinstance(sealed, str):
        try:
            return json.loads(base64.b64decode(sealed))["reasoning"]
        except (ValueError, KeyError, TypeError):
            raise RequestError("a reasoning item's encrypted_content was not made by this server",
                               param="input") from None
    return ""


def seal(reasoning: str) -> str:
    return base64.b64encode(json.dumps({"reasoning": reasoning}).encode()).decode()


def input_messages(items) -> list[dict]:
    """Responses input items as OpenAI chat messages (dsv4.encoding's input)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise RequestError("'input' must be a string or a list of items", param="input")
    messages: list[dict] = []
    reasoning: Optional[str] = None   # a reasoning item belongs to the assistant turn that follows it

    def assistant() -> dict:
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or reasoning is not None:
            last = {"role": "assistant", "content": None}
            messages.append(last)
        if reasoning is not None:
            last["reasoning_content"], reasoning = reasoning, None
        return last

    for n, item in enumerate(items):
        where = f"input[{n}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "system", "assistant"):
                raise RequestError(f"{where}: unsupported role {item.get('role')!r}", param="input")
            text = _text_of(item.get("content"), where)
            if role == "assistant":
                message = assistant()
                message["content"] = (message["content"] or "") + text
            else:
                messages.append({"role": role, "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise RequestError(f"{where}: a {kind} needs 'name' and 'call_id'", param="input")
            arguments = item.get("arguments") or "{}" if kind == "function_call" else \
                custom_arguments(item.get("input") or "")
            message = assistant()
            message.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                             "content": _text_of(output, where) if not isinstance(output, str) else output})
        elif kind == "reasoning":
            reasoning = reasoning_text(item)
        else:
            raise RequestError(f"{where}: items of type {kind!r} are not supported", param="input")
    return messages


def custom_input(arguments: str) -> str:
    """A custom tool's free-text input from the arguments of the call the model made."""
    try:
        value = json.loads(arguments).get("input", "")
    except (ValueError, AttributeError):
        return arguments
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def custom_arguments(text: str) -> str:
    """The arguments a custom tool's call carries in DSML: its input as one string parameter."""
    return json.dumps({"input": text}, ensure_ascii=False)


def custom_function(tool: dict) -> dict:
    """A custom (free-text input) tool as the function tool the model is shown: one string
    parameter `input`, whose grammar, if the tool has one, goes in the description."""
    description = tool.get("description") or ""
    fmt = tool.get("format") or {}
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        description += f"\n\nThe input follows this {fmt.get('syntax', 'lark')} grammar:\n{fmt['definition']}"
    return {"name": tool["name"], "description": description,
            "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}


def tools_of(body: dict) -> tuple[Optional[list], set, Choice]:
    """The function tools the model is shown, the names of those that are custom tools (their
    calls go back as custom_tool_call items), and what tool_choice asks (tool_choice.py)."""
    choice = openai_choice(body.get("tool_choice"), parallel=body.get("parallel_tool_calls"),
                           named_types=("function", "custom"))
    tools = body.get("tools")
    if tools is None:
        return None, set(), choice
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    out, custom = [], set()
    for n, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in ("function", "custom") or not isinstance(tool.get("name"), str):
            raise RequestError(f"tools[{n}]: only function and custom tools are supported (got type {kind!r})",
                               param="tools")
        if kind == "custom":
            custom.add(tool["name"])
            function = custom_function(tool)
        else:
            function = {"name": tool["name"], "description": tool.get("description") or "",
                        "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": function})
    return out, custom, choice


def text_format(body: dict) -> Optional[dict]:
    """text.format as a chat response_format (what the encoder shows and the constraint enforces)."""
    text = body.get("text") or {}
    if not isinstance(text, dict):
        raise RequestError("'text' must be an object", param="text")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError("text.format json_schema needs a 'schema' object", param="text.format")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"],
                                                       "strict": fmt.get("strict", True)}}
    raise RequestError("text.format type must be text, json_object or json_schema", param="text.format")


def reasoning_mode(body: dict, default: bool) -> tuple[str, Optional[object]]:
    reasoning = body.get("reasoning") or {}
    if not isinstance(reasoning, dict):
        raise RequestError("'reasoning' must be an object", param="reasoning")
    effort = reasoning.get("effort")
    if effort is None:
        return ("thinking" if default else "chat"), None
    if effort == "none":
        return "chat", None
    if effort not in EFFORTS:
        raise RequestError(f"reasoning.effort must be one of none, {', '.join(EFFORTS)}; got {effort!r}",
                           param="reasoning.effort")
    return "thinking", EFFORTS[effort]


class Store:
    """Responses kept for GET and previous_response_id: id -> (response object, conversation)."""

    def __init__(self, limit: int = STORED_RESPONSES):
        self.limit = limit
        self.items: OrderedDict[str, tuple[dict, list]] = OrderedDict()

    def put(self, response: dict, conversation: list) -> None:
        self.items[response["id"]] = (response, conversation)
        while len(self.items) > self.limit:
            self.items.popitem(last=False)

    def get(self, ident: str, param: Optional[str] = None) -> tuple[dict, list]:
        if ident not in self.items:
            raise RequestError(f"no response with id {ident!r} is stored here", param=param,
                               status=404 if param is None else 400)
        return self.items[ident]


def routes(service: Service) -> list[Route]:
    store = service.stored.setdefault("responses", Store())

    async def create(request: Request):
        return await respond(request, service, store)

    async def fetch(request: Request):
        try:
            return JSONResponse(store.get(request.path_params["ident"])[0])
        except RequestError as error:
            return openai_error(error)

    async def delete(request: Request):
        try:
            store.get(request.path_params["ident"])
        except RequestError as error:
            return openai_error(error)
        del store.items[request.path_params["ident"]]
        return JSONResponse({"id": request.path_params["ident"], "object": "response", "deleted": True})

    return [Route("/v1/responses", create, methods=["POST"]),
            Route("/v1/responses/{ident}", fetch, methods=["GET"]),
            Route("/v1/responses/{ident}", delete, methods=["DELETE"])]


async def respond(request: Request, service: Service, store: Store):
    generation = None
    try:
        body = await read_json(request)
        opt.refuse_unsupported(body, UNSUPPORTED)
        history = []
        if body.get("previous_response_id") is not None:
            history = list(store.get(body["previous_response_id"], "previous_response_id")[1])
        conversation = history + input_messages(body.get("input"))
        if not conversation:
            raise RequestError("'input' is empty", param="input")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise RequestError("'instructions' must be a string", param="instructions")
        mode, effort = reasoning_mode(body, service.thinking)
        response_format = text_format(body)
        tools, custom, choice = tools_of(body)
        prompt = opt.Prompt(([{"role": "system", "content": instructions}] if instructions else []) + conversation,
                            mode, tools, response_format, effort, param="input", tool_choice=choice)
        tokens = service.tokenize(prompt)   # ids and the replay records they took
        limits = opt.Limits(opt.max_tokens(body, ("max_output_tokens",), service.default_max_tokens),
                            sampling=opt.sampling(body, SAMPLING, service.scheduler.vocab_size))
        stream = opt.boolean(body, "stream")
        keep = opt.boolean(body, "store", default=True)
        generation = Generation(service.scheduler, tokens, limits, mode,
                                constraint_for(prompt, service, "text.format"), prompt.param)
        generation.watch(request)
        await generation.start()
    except RequestError as error:
        if generation is not None:
            generation.close()
        return openai_error(error)
    except ClientGone:
        generation.close()
        return JSONResponse({})
    answer = Answer(body, body.get("model") or service.model_name, generation, conversation,
                    store if keep else None, custom)
    if stream:
        return StreamingResponse(answer.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        async for _ in answer.items():
            pass
        return JSONResponse(answer.response())
    except RequestError as error:
        return openai_error(error)
    except ClientGone:
        return JSONResponse({})
    finally:
        generation.close()


class Answer:
    """One response: its output items built from the generation's deltas, as events or whole."""

    def __init__(self, body: dict, model: str, generation: Generation, conversation: list, store: Optional[Store],
                 custom: set):
        """custom: names of the custom tools (their calls are custom_tool_call items)."""
        self.body, self.model, self.generation, self.conversation, self.store = body, model, generation, conversation, store
        self.custom = custom
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.output: list[dict] = []
        self.sequence = 0
        self.status = "in_progress"

    def response(self) -> dict:
        g = self.generation
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
               "model": self.model, "output": self.output, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
               "instructions": self.body.get("instructions"), "metadata": self.body.get("metadata") or {},
               "parallel_tool_calls": self.body.get("parallel_tool_calls", True),
               "previous_response_id": self.body.get("previous_response_id"),
               "temperature": self.body.get("temperature"), "top_p": self.body.get("top_p"),
               "max_output_tokens": self.body.get("max_output_tokens"),
               "tool_choice": self.body.get("tool_choice") or "auto", "tools": self.body.get("tools") or [],
               "text": self.body.get("text") or {"format": {"type": "text"}},
               "reasoning": self.body.get("reasoning") or {"effort": None, "summary": None},
               "store": self.store is not None, "truncation": self.body.get("truncation") or "disabled",
               "user": self.body.get("user"), "usage": None}
        if self.status != "in_progress":
            out["usage"] = {"input_tokens": g.prompt_tokens,
                            "input_tokens_details": {"cached_tokens": g.cached_tokens, "cache_write_tokens": 0},
                            "output_tokens": g.completion_tokens,
                            "output_tokens_details": {"reasoning_tokens": g.reasoning_tokens},
                            "total_tokens": g.prompt_tokens + g.completion_tokens}
        return out

    def event(self, kind: str, **fields) -> str:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence, **fields}, event=kind)

    async def items(self):
        """Events (as SSE strings) while the output items are built from the deltas."""
        current: Optional[dict] = None   # the item deltas go to, while it is open

        def done(item: dict):
            """The events that close an item."""
            item["status"] = "completed"
            index = self.output.index(item)
            if item["type"] == "message":
                part = item["content"][0]
                yield self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=part["text"], logprobs=[])
                yield self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part)
            elif item["type"] == "reasoning":
                part = item["content"][0]
                item["encrypted_content"] = seal(part["text"])
                yield self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=part["text"])
                yield self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part)
            yield self.event("response.output_item.done", output_index=index, item=item)

        def opened(item: dict, part: Optional[dict]):
            self.output.append(item)
            index = len(self.output) - 1
            yield self.event("response.output_item.added", output_index=index, item=json.loads(json.dumps(item)))
            if part is not None:
                item["content"].append(part)
                yield self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                 content_index=0, part=dict(part))

        async for delta in self.generation.deltas():
            kind = {"reasoning": "reasoning", "content": "message"}.get(delta.kind, "function_call")
            if current is not None and (current["type"] != kind or kind == "function_call"):
                for event in done(current):
                    yield event
                current = None
            if kind == "function_call":
                for event in self.call(delta.tool_call, opened, done):
                    yield event
                continue
            if current is None:
                if kind == "message":
                    current = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "status": "in_progress",
                               "role": "assistant", "content": []}
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                else:
                    current = {"id": "rs_" + uuid.uuid4().hex[:24], "type": "reasoning", "status": "in_progress",
                               "summary": [], "content": []}
                    part = {"type": "reasoning_text", "text": ""}
                for event in opened(current, part):
                    yield event
            current["content"][0]["text"] += delta.text
            name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            extra = {"logprobs": []} if kind == "message" else {}
            yield self.event(name, item_id=current["id"], output_index=len(self.output) - 1, content_index=0,
                             delta=delta.text, **extra)
        if current is not None:
            for event in done(current):
                yield event
        self.status = "incomplete" if self.generation.finish == "length" else "completed"
        if self.store is not None:
            self.store.put(self.response(), self.conversation + [self.as_message()])

    def call(self, call, opened, done):
        """The events of one tool call's item: a function_call, or a custom_tool_call for a custom tool."""
        ident = "call_" + uuid.uuid4().hex[:24]
        if call.name in self.custom:
            text = custom_input(call.arguments)
            item = {"id": "ctc_" + uuid.uuid4().hex[:24], "type": "custom_tool_call", "status": "in_progress",
                    "call_id": ident, "name": call.name, "input": ""}
            names, fields = ("response.custom_tool_call_input.delta", "response.custom_tool_call_input.done"), \
                ({"delta": text}, {"input": text})
            value = ("input", text)
        else:
            item = {"id": "fc_" + uuid.uuid4().hex[:24], "type": "function_call", "status": "in_progress",
                    "call_id": ident, "name": call.name, "arguments": ""}
            names, fields = ("response.function_call_arguments.delta", "response.function_call_arguments.done"), \
                ({"delta": call.arguments}, {"name": call.name, "arguments": call.arguments})
            value = ("arguments", call.arguments)
        yield from opened(item, None)
        item[value[0]] = value[1]
        index = len(self.output) - 1
        for name, extra in zip(names, fields):
            yield self.event(name, item_id=item["id"], output_index=index, **extra)
        yield from done(item)

    def as_message(self) -> dict:
        """The output as the assistant message a later turn's prompt renders."""
        message = {"role": "assistant", "content": "".join(
            i["content"][0]["text"] for i in self.output if i["type"] == "message")}
        reasoning = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "reasoning")
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = [{"id": i["call_id"], "type": "function", "function": {
            "name": i["name"], "arguments": i["arguments"] if i["type"] == "function_call" else custom_arguments(i["input"])}}
            for i in self.output if i["type"] in ("function_call", "custom_tool_call")]
        if calls:
            message["tool_calls"] = calls
        return message

    async def stream(self):
        try:
            yield self.event("response.created", response=self.response())
            yield self.event("response.in_progress", response=self.response())
            async for event in self.items():
                yield event
            kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
            yield self.event(kind, response=self.response())
        except RequestError as error:
            self.status = "failed"
            failed = self.response()
            failed["error"] = {"code": error.code or error.kind, "message": str(error)}
            yield self.event("response.failed", response=failed)
        except ClientGone:
            return
        finally:
            self.generation.close()
