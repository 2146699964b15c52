"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import re

from starlette.responses import JSONResponse

_FIELD = re.compile(r"^([a-z_][a-z0-9_]*)\b")
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class HttpError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status)


def bad_request(message: str, param: str | None = None) -> HttpError:
    """400; ``param`` defaults to the field a validation message starts with."""
    if param is None:
        match = _FIELD.match(message)
        param = match.group(1) if match else None
    return HttpError(400, message, param, "invalid_value")
