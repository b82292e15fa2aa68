"""OpenAI's /v1/chat/completions and /v1/completions, streaming (SSE) or not.

Chat takes messages with tools (tool_choice auto, none, required or a named function, enforced
by a grammar: tool_choice.py), tool calls and their results, `reasoning_content` on assistant
messages, and thinking on or off by DeepSeek's `thinking: {type}`, vLLM's
`chat_template_kwargs: {thinking}` or `reasoning_effort`. Answers carry `reasoning_content`,
`tool_calls`, and `usage.prompt_tokens_details.cached_tokens` (prompt tokens the prefix cache
gave). Parameters this server does not implement get a 400 naming them.
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from . import options as opt
from .service import Service, openai_error, openai_error_body, read_json, sse
from .errors import RequestError
from .output import ClientGone, Generation
from .structured import constraint_for
from .tool_choice import Choice, openai_choice

# OpenAI's sampling parameters and their names in dsv4.sampling.Sampling.
SAMPLING = {"temperature": "temp", "top_p": "top_p", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias"}

UNSUPPORTED = {
    "n": (lambda v: v in (None, 1), "only n=1 is supported"),
    "best_of": (lambda v: v in (None, 1), "only best_of=1 is supported"),
    "echo": (lambda v: v in (None, False), "echo is not supported"),
    "suffix": (lambda v: v in (None, ""), "suffix is not supported"),
    "logprobs": (lambda v: v is None or v is False, "logprobs are not supported"),
    "top_logprobs": (lambda v: v in (None, 0), "top_logprobs are not supported"),
    "functions": (lambda v: v is None, "'functions' is not supported; use 'tools'"),
    "function_call": (lambda v: v is None, "'function_call' is not supported; use 'tool_choice'"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only the text modality is supported"),
}


def limits(body: dict, service: Service, token_names: tuple[str, ...]) -> opt.Limits:
    opt.refuse_unsupported(body, UNSUPPORTED)
    return opt.Limits(max_tokens=opt.max_tokens(body, token_names, service.default_max_tokens),
                      stops=opt.stop_strings(body.get("stop")),
                      sampling=opt.sampling(body, SAMPLING, service.scheduler.vocab_size),
                      seed=opt.seed(body))


def thinking_mode(body: dict, default: bool) -> tuple[str, Optional[object]]:
    """thinking on/off from DeepSeek's `thinking: {type}`, vLLM's `chat_template_kwargs:
    {thinking}` or an OpenAI `reasoning_effort` (which also sets the effort)."""
    effort = body.get("reasoning_effort")
    if effort == "none":  # OpenAI's way of asking for no reasoning
        effort, default = None, False
    thinking = default if effort is None else True
    switch = body.get("thinking")
    if switch is not None:
        if not isinstance(switch, dict) or switch.get("type") not in ("enabled", "disabled"):
            raise RequestError("'thinking' must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"}",
                               param="thinking")
        thinking = switch["type"] == "enabled"
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    if "thinking" in kwargs:
        thinking = bool(kwargs["thinking"])
    return ("thinking" if thinking else "chat"), opt.effort(effort, "reasoning_effort")


def check_contents(messages: list) -> None:
    """Messages the encoder would read as empty text (it takes a missing content for ""):
    user and tool messages must say something, a system message must have content, an
    assistant message content or tool calls."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue  # the encoder names what is wrong with it
        role, content, where = message.get("role"), message.get("content"), f"messages[{i}]"
        if role in ("user", "tool") and content in (None, "", []):
            raise RequestError(f"{where}: a {role} message needs a non-empty 'content'", param="messages")
        if role == "system" and content is None:
            raise RequestError(f"{where}: a system message needs 'content'", param="messages")
        if role == "assistant" and content is None and not message.get("tool_calls"):
            raise RequestError(f"{where}: an assistant message needs 'content' or 'tool_calls'", param="messages")


def response_format(value) -> Optional[dict]:
    """OpenAI's response_format: None for text; json_object or json_schema as given."""
    if value is not None and (not isinstance(value, dict)
                              or value.get("type") not in ("text", "json_object", "json_schema")):
        raise RequestError("'response_format' must be an object with type text, json_object or json_schema",
                           param="response_format")
    if value and value["type"] == "json_schema" and not isinstance(value.get("json_schema"), dict):
        raise RequestError("response_format json_schema needs a 'json_schema' object", param="response_format")
    return None if not value or value["type"] == "text" else value


def tools_and_choice(body: dict) -> tuple[Optional[list], Choice]:
    """The tools the model is shown and what tool_choice asks of it (tool_choice.py)."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    return tools, openai_choice(body.get("tool_choice"), parallel=body.get("parallel_tool_calls"))


def chat_prompt(body: dict, default_thinking: bool) -> opt.Prompt:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    check_contents(messages)
    tools, choice = tools_and_choice(body)
    mode, effort = thinking_mode(body, default_thinking)
    return opt.Prompt(messages, mode, tools, response_format(body.get("response_format")), effort,
                      tool_choice=choice)


def routes(service: Service) -> list[Route]:
    async def chat(request: Request):
        return await complete(request, service, "chat")

    async def text(request: Request):
        return await complete(request, service, "text")

    return [Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", text, methods=["POST"])]


async def complete(request: Request, service: Service, kind: str):
    generation = None
    try:
        body = await read_json(request)
        if kind == "chat":
            prompt = chat_prompt(body, service.thinking)
            tokens, mode = service.tokenize(prompt), prompt.mode   # ids and the replay records they took
            constraint = constraint_for(prompt, service, "response_format")
        else:
            text = body.get("prompt")
            if not isinstance(text, str) or not text:
                raise RequestError("'prompt' must be a non-empty string", param="prompt")
            tokens, mode, constraint = (service.scheduler.tokenizer.encode(text, add_special_tokens=False), []), None, None
            if not tokens[0]:
                raise RequestError("the prompt encodes to no tokens", param="prompt")
        stream = opt.boolean(body, "stream")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise RequestError("'stream_options' must be an object", param="stream_options")
        generation = Generation(service.scheduler, tokens, limits(body, service, ("max_completion_tokens", "max_tokens")),
                                mode, constraint)
        generation.watch(request)
        await generation.start()
    except RequestError as error:
        if generation is not None:
            generation.close()
        return openai_error(error)
    except ClientGone:
        generation.close()
        return JSONResponse({})
    answer = Answer(kind, body.get("model") or service.model_name, generation)
    if stream:
        return StreamingResponse(answer.stream(bool(stream_options.get("include_usage"))),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        return JSONResponse(await answer.whole())
    except RequestError as error:
        return openai_error(error)
    except ClientGone:
        return JSONResponse({})
    finally:
        generation.close()


class Answer:
    """One completion in OpenAI's chunks (streaming) or objects (whole)."""

    def __init__(self, kind: str, model: str, generation: Generation):
        self.kind, self.model, self.generation = kind, model, generation
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.calls: list[dict] = []

    def chunk(self, delta: dict, finish_reason=None) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta.get("content", ""), "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice]}

    def call(self, tool_call) -> dict:
        call = {"index": len(self.calls), "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": tool_call.name, "arguments": tool_call.arguments}}
        self.calls.append(call)
        return call

    def usage(self) -> dict:
        g = self.generation
        return {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens,
                "total_tokens": g.prompt_tokens + g.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": g.cached_tokens}}

    async def stream(self, include_usage: bool):
        g = self.generation
        try:
            if self.kind == "chat":
                yield sse(self.chunk({"role": "assistant", "content": ""}))
            async for delta in g.deltas():
                if delta.kind == "tool_call":
                    yield sse(self.chunk({"tool_calls": [self.call(delta.tool_call)]}))
                else:
                    key = "reasoning_content" if delta.kind == "reasoning" else "content"
                    yield sse(self.chunk({key: delta.text}))
            yield sse(self.chunk({}, g.finish))
            if include_usage:
                yield sse({"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                           "choices": [], "usage": self.usage()})
        except RequestError as error:
            yield sse(openai_error_body(error))
        except ClientGone:
            return
        finally:
            g.close()
        yield sse("[DONE]")

    async def whole(self) -> dict:
        g = self.generation
        text, reasoning = [], []
        async for delta in g.deltas():
            if delta.kind == "tool_call":
                self.call(delta.tool_call)
            else:
                (reasoning if delta.kind == "reasoning" else text).append(delta.text)
        if self.kind == "text":
            payload = self.chunk({"content": "".join(text)}, g.finish)
        else:
            content = "".join(text)
            message = {"role": "assistant", "content": content if content or not self.calls else None}
            if g.mode == "thinking":
                message["reasoning_content"] = "".join(reasoning)
            if self.calls:
                message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
            payload = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                       "choices": [{"index": 0, "message": message, "finish_reason": g.finish}]}
        payload["usage"] = self.usage()
        return payload
