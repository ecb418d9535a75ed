"""Errors in OpenAI's shape (`kvferry.protocol.errors`), raised and answered by the server.

Every failure the server answers goes through `ApiError` or one of the handlers that
`install_error_handlers` registers, so a client always gets this body and invalid input
always gets a 4xx: malformed JSON, a body that does not match the schema, and values the
engine refuses all become 400s naming the field.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvferry.protocol.errors import error_body, http_error_message

logger = logging.getLogger(__name__)
# The per-request log lines (one per request, served or refused).
request_logger = logging.getLogger("kvferry.engine.server.requests")

class ApiError(Exception):
    """An error answered to the client with `status` and an OpenAI error body."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        # Whether the request's log line was written already (it failed mid-generation).
        self.is_logged = False


def bad_request(message: str, param: str | None = None) -> ApiError:
    """400: the request is invalid; `param` names the offending field."""
    return ApiError(400, message, param=param)


def unavailable(message: str) -> ApiError:
    """503: the server cannot take requests now (loading, draining or engine dead)."""
    return ApiError(503, message, code="service_unavailable")


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A one-line message and the `param` of pydantic/FastAPI validation errors.

    Each error's location drops FastAPI's leading "body"; the first error's location is
    the param. Example: `[{"loc": ("body", "temperature"), "msg": "Input should be a valid
    number"}]` -> ("temperature: Input should be a valid number", "temperature").
    """
    parts = []
    first_param = None
    for error in errors:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        field = _dotted(loc)
        if error.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {error.get('ctx', {}).get('error', '')}")
            continue
        if first_param is None and field:
            first_param = field
        parts.append(f"{field}: {error.get('msg', 'invalid')}" if field else error.get("msg", ""))
    return "; ".join(parts) or "invalid request", first_param


# Location parts pydantic adds for the members of a union ("prompt", "list[int]", 0).
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "tuple"})


def _is_type_tag(part: str) -> bool:
    return part in _TYPE_TAGS or "[" in part or "-" in part


def _dotted(loc: list[str]) -> str:
    """("messages", "0", "content") -> "messages[0].content"; union member tags dropped."""
    out = ""
    for part in loc:
        if _is_type_tag(part):
            continue
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out


def log_refusal(request: Request, status: int, message: str) -> None:
    """The one log line of a request refused before it reached the engine."""
    request_id = getattr(request.state, "request_id", None)
    request_logger.info("request_id=%s path=%s status=%d error=%r", request_id,
                        request.url.path, status, message)


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    if not exc.is_logged:
        log_refusal(request, exc.status, exc.message)
    return error_response(exc.status, exc.message, exc.param, exc.code)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = validation_message(exc.errors())
    log_refusal(request, 400, message)
    return error_response(400, message, param)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(exc.status_code, http_error_message(exc.status_code, exc.detail))


async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    request_id = getattr(request.state, "request_id", None)
    logger.exception("request %s failed unexpectedly", request_id)
    return error_response(500, f"internal error: {type(exc).__name__}")


def install_error_handlers(app: FastAPI) -> None:
    """Routes every error the app can raise to an OpenAI-shaped body."""
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)
