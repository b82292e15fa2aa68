"""The HTTP app: every dialect's routes and the shared ones, served by uvicorn through Starlette.

Starlette rather than http.server, because four API dialects stream: an async generator per
response is the whole of a stream here (StreamingResponse writes it, and cancels it when the
client goes), where http.server wanted a thread per request, hand-written chunking and a socket
poll to notice a client leaving. A handler waits on its generation's events without holding a
thread, so a queue of agents costs nothing while the scheduler serves the batch.

Each dialect module (openai_chat, openai_responses, anthropic_messages) gives its routes; they
share the `Service` and the HTTP helpers of service.py.
"""

from __future__ import annotations

import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from . import anthropic_messages, openai_chat, openai_responses
from .errors import RequestError
from .service import Service, openai_error


def make_app(service: Service) -> Starlette:
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
