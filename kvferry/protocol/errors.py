"""The error body every kvferry server answers with, in OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

# HTTP status -> OpenAI error `type`.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


class InvalidRequest(ValueError):
    """A body the servers refuse with a 400; `param` names the offending field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The JSON body of an error response."""
    error_type = ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def http_error_message(status: int, detail: object) -> str:
    """What an HTTP-level error (an unknown path or method) says: its detail when that is
    text, else its status's phrase."""
    if isinstance(detail, str):
        return detail
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "error"
