"""One step's token budget, and what the scheduler has taken from it so far."""

from __future__ import annotations

from kvferry.engine.core.request import Request


class StepBudget:
    """The step's tokens left, and per request: tokens taken, new blocks, filled blocks."""

    def __init__(self, tokens: int, block_size: int, encoder_tokens: int = 0) -> None:
        self.tokens = tokens
        self.block_size = block_size
        # Encoder positions the step may still run (encoder-decoder models), and the
        # requests whose encoder runs this step, with their encoder inputs' keys.
        self.encoder_tokens = encoder_tokens
        self.encoder_requests: list[Request] = []
        self.encoder_keys: set[bytes] = set()
        self.scheduled: dict[str, int] = {}
        self.requests: dict[str, Request] = {}
        # Blocks appended to a request's table this step (at most one allocation each).
        self.new_block_ids: dict[str, list[int]] = {}
        # Requests whose tokens this step complete at least one block: their hashes are
        # indexed once the step has run.
        self.filling: dict[str, Request] = {}
        # Hashes of the full blocks computed this step; built when first needed.
        self._in_flight_hashes: set[bytes] | None = None

    def take_many(self, requests: list[Request], req_ids: list[str], num_tokens: list[int]) -> None:
        self.tokens -= sum(num_tokens)
        self.scheduled.update(zip(req_ids, num_tokens))
        self.requests.update(zip(req_ids, requests))

    def take(self, request: Request, num_tokens: int) -> None:
        """Schedules `num_tokens` of a request that had `num_computed_tokens` before them."""
        self.tokens -= num_tokens
        self.scheduled[request.request_id] = num_tokens
        self.requests[request.request_id] = request
        first = request.num_computed_tokens // self.block_size
        end = (request.num_computed_tokens + num_tokens) // self.block_size
        if end > first:
            self.filling[request.request_id] = request
            if self._in_flight_hashes is not None:
                self._in_flight_hashes.update(request.block_hashes[first:end])

    def take_encoder(self, request: Request) -> None:
        """Runs a request's encoder this step."""
        assert request.encoder_key is not None
        self.encoder_tokens -= request.num_encoder_tokens
        self.encoder_requests.append(request)
        self.encoder_keys.add(request.encoder_key)

    def untake(self, request: Request) -> None:
        """Gives back what a preempted request took (its blocks were freed with it)."""
        self.tokens += self.scheduled.pop(request.request_id, 0)
        self.requests.pop(request.request_id, None)
        self.new_block_ids.pop(request.request_id, None)
        self.filling.pop(request.request_id, None)
        self._in_flight_hashes = None

    def computes_block(self, block_hash: bytes) -> bool:
        """Whether a request scheduled so far computes the full block with this hash."""
        if self._in_flight_hashes is None:
            self._in_flight_hashes = self._hashes_in_flight()
        return block_hash in self._in_flight_hashes

    def filled_block_hashes(self) -> set[bytes]:
        """Hashes of the full blocks the step's tokens complete (called before the
        requests' `num_computed_tokens` advance past them)."""
        hashes: set[bytes] = set()
        for req_id, request in self.filling.items():
            first = request.num_computed_tokens // self.block_size
            end = (request.num_computed_tokens + self.scheduled.get(req_id, 0)) // self.block_size
            hashes.update(request.block_hashes[first:end])
        return hashes

    def _hashes_in_flight(self) -> set[bytes]:
        in_flight: set[bytes] = set()
        for req_id, num_tokens in self.scheduled.items():
            request = self.requests[req_id]
            # num_computed_tokens is advanced only once scheduling is done.
            first = request.num_computed_tokens // self.block_size
            end = (request.num_computed_tokens + num_tokens) // self.block_size
            in_flight.update(request.block_hashes[first:end])
        return in_flight
