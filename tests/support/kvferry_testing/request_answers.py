"""How the engine pods' request models and the router's checks answer one body: the
`param` each refuses it with, or None. Tests hold the two sides together with these."""

from __future__ import annotations

from typing import Any

from kvferry.engine.server.errors import ApiError, validation_message
from kvferry.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from pydantic import BaseModel, ValidationError

from kvferry.protocol.request_checks import InvalidRequest, check_body

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MODELS: dict[str, type[BaseModel]] = {COMPLETIONS: CompletionRequest,
                                      CHAT: ChatCompletionRequest}


def engine_answer(endpoint: str, body: dict[str, Any], *, sampling: bool = False) -> str | None:
    """The param of the engine's refusal, or None when it takes the body: its model's
    validation, and with `sampling` also the sampling params built from it."""
    try:
        request = MODELS[endpoint].model_validate(body)
        if sampling:
            request.to_sampling_params()  # type: ignore[attr-defined]
    except ApiError as exc:
        assert exc.status == 400
        return exc.param
    except ValidationError as exc:
        return validation_message(exc.errors())[1]
    return None


def router_answer(endpoint: str, body: dict[str, Any]) -> str | None:
    """The param of the router's refusal, or None."""
    try:
        check_body(endpoint, body)
    except InvalidRequest as exc:
        return exc.param
    return None
