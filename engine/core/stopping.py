"""When a request stops: stop tokens, length caps, and `min_tokens` holding stops back."""

from __future__ import annotations

from kvferry.engine.core.request import Request, RequestStatus


def check_stop(request: Request, token_id: int) -> RequestStatus | None:
    """The finished status a just-sampled token gives the request, or None to go on."""
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens and token_id in request.stop_token_set:
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED
    # A length cap ends the request even before min_tokens: nothing runs past max_model_len.
    if num_output >= request.max_output_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


class MinTokensGuard:
    """Requests with fewer outputs than their `min_tokens`: the sampler may not stop them."""

    def __init__(self) -> None:
        self._pending: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        if request.sampling_params.min_tokens > 0:
            self._pending[request.request_id] = request

    def discard(self, req_id: str) -> None:
        self._pending.pop(req_id, None)

    def blocked_stop_tokens(self, scheduled: dict[str, int]) -> dict[str, list[int]]:
        """Per scheduled request still short of `min_tokens`: the token ids it may not sample."""
        blocked = {}
        for req_id, request in list(self._pending.items()):
            params = request.sampling_params
            # Tokens sampled by steps in flight (async scheduling) count: the step
            # being planned comes after them.
            if request.num_output_tokens + request.num_output_placeholders >= params.min_tokens:
                del self._pending[req_id]
            elif req_id in scheduled:
                eos = () if params.ignore_eos else request.eos_token_ids
                blocked[req_id] = [*eos, *params.stop_token_ids]
        return blocked
