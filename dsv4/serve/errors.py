"""A request the server refuses, in terms every API dialect can render."""

from __future__ import annotations

from typing import Optional


class RequestError(Exception):
    """HTTP status, message, and the fields OpenAI's error body has (`param`, `code`, `kind`
    = its `type`); the Anthropic dialect renders the same error in its own shape."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind


def shutting_down() -> RequestError:
    return RequestError("the server is shutting down; the generation was stopped", status=503,
                        kind="server_error")
