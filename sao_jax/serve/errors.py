"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Statuses (docs/harness.md): 400 invalid request (`param` names the field; a prompt past
the context has code `context_length_exceeded`), 401 missing or wrong key, 404 unknown
session, model or route, 409 the session has ended, 413 body too large, 429 over
capacity (with `Retry-After`). Every 4xx but 429 carries `x-should-retry: false`, so the
OpenAI clients do not retry what cannot succeed.
"""

from __future__ import annotations

from typing import Any

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """An HTTP error reply; `body()` is OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        out = {}
        if 400 <= self.status < 500 and self.status != 429:
            out["x-should-retry"] = "false"
        if self.retry_after is not None:
            out["Retry-After"] = str(max(1, round(self.retry_after)))
        return out


def invalid(param: str, message: str, code: str | None = None) -> ApiError:
    """A 400 naming the field."""
    return ApiError(400, f"{param}: {message}", param=param, code=code)
