"""The scheduler's bookkeeping for requests whose KV crosses engines.

Two kinds of request hold blocks without being scheduled:

- on a consumer, a request WAITING_FOR_REMOTE_KV: its blocks are allocated and a pull
  fills them. It leaves that state only through the connector's report (the pull
  succeeded, failed, or timed out: the worker fails a pull past `pull_timeout_s`), so it
  can never wait forever;
- on a producer (or a consumer whose request finished mid-pull), a finished request whose
  blocks are *kept*: a remote decode may still read them, or a read may still write them.
  They are freed only when the connector lists the request in `free`.

Invariant: a pulled block enters the prefix-cache index only after its pull succeeded
(`take_ready`); a failed or cancelled pull's blocks are freed without being indexed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvferry.engine.core.kv_cache import KVCacheManager
from kvferry.engine.core.kv_connector import (
    FailurePolicy,
    FinishedTransfers,
    KVConnectorSchedulerBase,
    TransferFailure,
)
from kvferry.engine.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class TransferOutcome:
    """What the scheduler must do after the connector's report."""

    # Requests whose pulled KV is in their blocks: back to the waiting queue's front.
    ready: list[Request] = field(default_factory=list)
    # Requests whose pull failed, with why.
    failed: list[tuple[Request, TransferFailure]] = field(default_factory=list)


class RemoteKV:
    """Requests parked for a pull and finished requests whose blocks are kept."""

    def __init__(self, connector: KVConnectorSchedulerBase, manager: KVCacheManager) -> None:
        self.connector = connector
        self._manager = manager
        # Parked requests -> tokens their pull brings (past their local prefix hits).
        self.waiting_for_remote: dict[str, tuple[Request, int]] = {}
        # Finished requests whose blocks wait for the connector's `free`.
        self.kept: dict[str, Request] = {}
        # Requests whose pull failed and were computed here instead (cumulative).
        self.num_fallbacks = 0
        # Encoder-decoder requests whose encoder pod's cross blocks were cached here already.
        self.num_cross_cache_hits = 0

    @property
    def failure_policy(self) -> FailurePolicy:
        return self.connector.failure_policy

    def __len__(self) -> int:
        return len(self.waiting_for_remote) + len(self.kept)

    # ------------------------------------------------------------------ arrival
    def add_request(self, request: Request) -> None:
        self.connector.add_request(request.request_id, request.kv_transfer_params)

    def num_external_tokens(self, request: Request, num_hit_tokens: int) -> int:
        """Prompt tokens past the local hits that a pull would bring (0: compute them)."""
        num_external = self.matched_tokens(request, num_hit_tokens)
        return 0 if num_external is None else num_external

    def matched_tokens(self, request: Request, num_hit_tokens: int) -> int | None:
        """As `num_external_tokens`, but None when the held KV was computed for another
        prompt: never pulled; the fallback is counted once and the pull dropped (the
        producer's hold let go), so the request computes its own."""
        num_external = self.connector.get_num_new_matched_tokens(
            request.kv_transfer_params, request.prompt_token_ids, num_hit_tokens,
            request.cache_salt,
        )
        if num_external is None:
            logger.warning("request %s: its remote KV was computed for another prompt; "
                           "computing it here", request.request_id)
            self.num_fallbacks += 1
            self.drop_pull(request)
        return num_external

    def park(self, request: Request, num_hit_tokens: int, num_external: int,
             pulls_cross: bool = True) -> None:
        """Plans the pull of a request whose blocks were just allocated (an encoder-decoder
        request's cross-attention blocks as group 1, unless `pulls_cross` is False: they
        are cached here)."""
        block_ids = self._manager.get_block_id_groups(request.request_id)
        if not pulls_cross:
            block_ids = block_ids[:1]
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_remote[request.request_id] = (request, num_external)
        self.connector.update_state_after_alloc(
            request.request_id, request.kv_transfer_params, block_ids, num_hit_tokens, num_external
        )

    def compute_locally(self, request: Request) -> None:
        """A remote-prefill request that pulls nothing: the producer may free its hold (an
        encoder pod's too: the request's cross blocks are cached here, or its encoder
        runs here)."""
        if self.connector.is_pull(request.kv_transfer_params):
            self.drop_pull(request)

    def drop_pull(self, request: Request) -> None:
        """Forgets the request's pull (its params name KV it will not take): the producer's
        hold is let go, and what else the params asked for stands."""
        params = request.kv_transfer_params
        self.connector.update_state_after_alloc(request.request_id, params, [[]], 0, 0)
        request.kv_transfer_params = self.connector.after_pull(params)

    # ------------------------------------------------------------------ each step
    def update(self, output: object) -> TransferOutcome:
        """Applies the worker's report: ready and failed parked requests, freed kept blocks."""
        done: FinishedTransfers = self.connector.get_finished(output)
        outcome = TransferOutcome()
        for req_id in done.ready:
            outcome.ready.append(self._take_ready(req_id))
        for req_id, failure in done.failed.items():
            entry = self.waiting_for_remote.pop(req_id, None)
            if entry is None:
                continue  # finished meanwhile; its blocks were freed or are kept
            request = entry[0]
            request.kv_transfer_params = self.connector.after_pull(request.kv_transfer_params)
            outcome.failed.append((request, failure))
        for req_id in done.free:
            self._manager.free(self.kept.pop(req_id))
        return outcome

    def _take_ready(self, req_id: str) -> Request:
        request, num_external = self.waiting_for_remote.pop(req_id)
        request.num_computed_tokens += num_external
        # Over: a later preemption must recompute, the producer has freed its blocks.
        request.kv_transfer_params = self.connector.after_pull(request.kv_transfer_params)
        # Only now may other requests find these blocks (see the module invariant).
        self._manager.cache_full_blocks(request, request.num_computed_tokens)
        self._manager.cache_cross_blocks(request)
        request.status = RequestStatus.WAITING
        return request

    # ------------------------------------------------------------------ finish
    def remove_waiting(self, request: Request) -> None:
        del self.waiting_for_remote[request.request_id]

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Asks the connector whether a finished request's blocks must be kept.

        Returns the params for a remote decode (a producer's finished prefill). When the
        blocks are kept, the caller must not free them: `update` does once they are free.
        """
        aborted = request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
        keep, params = self.connector.request_finished(
            request.request_id, request.kv_transfer_params,
            self._manager.get_block_id_groups(request.request_id),
            request.all_token_ids, request.num_computed_tokens, aborted, request.cache_salt,
            request.encoder_key, request.num_encoder_tokens,
        )
        if keep:
            self.kept[request.request_id] = request
        return params
