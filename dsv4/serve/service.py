"""What the API dialects share: the `Service` (the scheduler, the replay records that tokenize
prompts, the command line's defaults) and the HTTP pieces every route uses: JSON bodies,
server-sent events, OpenAI's error shape. Below app.py, which gathers the dialects' routes."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse

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
