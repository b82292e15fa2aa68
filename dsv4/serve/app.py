"""The HTTP app: Starlette routes served by uvicorn, bodies, server-sent events, errors.

Starlette rather than http.server, because four API dialects stream: an async generator per
response is the whole of a stream here (StreamingResponse writes it, and cancels it when the
client goes), where http.server wanted a thread per request, hand-written chunking and a socket
poll to notice a client leaving. A handler waits on its generation's events without holding a
thread, so a queue of agents costs nothing while the scheduler serves the batch.

Each dialect module (openai_chat, openai_responses, anthropic_messages) gives its routes; they
share the `Service`: the scheduler, the replay records that tokenize prompts (replay.py), and
the defaults of the command line.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .errors import RequestError
from .options import Prompt

MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class Service:
    scheduler: object
    model_name: str
    default_max_tokens: int
    thinking: bool = False
    started: int = field(default_factory=lambda: int(time.time()))
    stored: dict = field(default_factory=dict)   # Responses API: what previous_response_id names

    def tokenize(self, prompt: Prompt) -> tuple[list[int], list]:
        """The prompt's ids and the replay records they took (replay.py)."""
        tokens, replayed = self.scheduler.replay.tokenize(prompt.segments())
        if not tokens:
            raise RequestError("the prompt encodes to no tokens", param=prompt.param)
        return tokens, replayed


async def read_json(request: Request) -> dict:
    """The request's JSON object, or a RequestError (411, 413, 400) saying what is wrong with it."""
    length = request.headers.get("content-length")
    if length is None and "chunked" not in request.headers.get("transfer-encoding", ""):
        raise RequestError("a JSON body with a Content-Length header is required", status=411)
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        raise RequestError(f"the body is larger than {MAX_BODY_BYTES} bytes", status=413)
    data = await request.body()
    if len(data) > MAX_BODY_BYTES:
        raise RequestError(f"the body is larger than {MAX_BODY_BYTES} bytes", status=413)
    try:
        body = json.loads(data or b"null")
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


def sse(data, event: Optional[str] = None) -> str:
    """One server-sent event: `data` as JSON (a str as is), named `event` if given."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


def openai_error_body(error: RequestError) -> dict:
    return {"error": {"message": str(error), "type": error.kind, "param": error.param, "code": error.code}}


def openai_error(error: RequestError) -> JSONResponse:
    return JSONResponse(openai_error_body(error), status_code=error.status)


def make_app(service: Service) -> Starlette:
    from . import anthropic_messages, openai_chat, openai_responses

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def models(request):
        """The one model, with the fields OpenAI's and Anthropic's clients read (and vLLM's
        max_model_len, where agents look for the context)."""
        name = service.model_name
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(service.started))
        return JSONResponse({"object": "list", "data": [{
            "id": name, "object": "model", "created": service.started, "owned_by": "dsv4",
            "type": "model", "display_name": name, "created_at": created,
            "max_model_len": service.scheduler.max_context}], "has_more": False, "first_id": name, "last_id": name})

    async def stats(request):
        return JSONResponse(service.scheduler.snapshot())

    async def unknown(request: Request, error: HTTPException):
        """404/405 in the shape of the API the path belongs to."""
        refusal = RequestError(f"no route {request.method} {request.url.path}", status=error.status_code)
        if request.url.path.startswith(anthropic_messages.PREFIX):
            return anthropic_messages.error_response(refusal)
        return openai_error(refusal)

    routes = [Route("/health", health), Route("/v1/models", models), Route("/v1/stats", stats),
              *openai_chat.routes(service), *openai_responses.routes(service),
              *anthropic_messages.routes(service)]
    return Starlette(routes=routes, exception_handlers={404: unknown, 405: unknown})
