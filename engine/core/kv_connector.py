"""The KV connector interface: the calls the engine core makes to move KV between engines.

The engine declares it; `kvferry.kvtransfer` implements it over NIXL. Split like vLLM's
`KVConnectorBase_V1`: a scheduler side that decides (which tokens of a new request arrive
from another engine, which blocks a pull fills, which blocks a finished request keeps) and a
worker side that moves bytes on its own thread. The engine core hands the worker the
scheduler side's metadata after each schedule and gives the worker's report back to the
scheduler side before the next one; both are opaque to the core.

A request's transfer parameters are opaque too: the front end parses and validates them
once (the connector's own parser), the core carries them on the request and passes them to
these hooks, and only the connector reads them. A request on a consuming engine:

1. `add_request` on arrival;
2. `get_num_new_matched_tokens` when it is first scheduled, after local prefix hits: the
   prompt tokens a pull will bring;
3. `update_state_after_alloc` once its blocks are allocated: the pull is planned and the
   request waits for remote KV (holding its blocks, never scheduled);
4. every step: `build_connector_meta` -> worker `apply` ... worker `get_finished` ->
   `get_finished` here, which lists requests whose KV arrived, whose pull failed, and
   finished requests whose kept blocks may be freed;
5. `request_finished` when it ends: a producer may keep its blocks for another engine and
   return the parameters that engine needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

# A request's transfer parameters as the connector parsed them; the core never reads them.
TransferParams = Any
# Block ids per KV cache group: group 0 is the decoder's self-attention cache.
BlockIdGroups = Sequence[Sequence[int]]
FailurePolicy = Literal["recompute", "fail"]


@dataclass(frozen=True)
class TransferFailure:
    """Why a request's pull failed."""

    reason: str  # a short label (also a metric label), e.g. "timeout"
    # For the log and the client: names the producer and what went wrong.
    message: str


@dataclass
class FinishedTransfers:
    """What the scheduler acts on after a step."""

    # Waiting requests whose remote KV arrived.
    ready: list[str] = field(default_factory=list)
    # Waiting requests whose pull failed; their blocks stay allocated, their KV is garbage.
    failed: dict[str, TransferFailure] = field(default_factory=dict)
    # Finished requests whose blocks were kept for a transfer and may be freed now.
    free: list[str] = field(default_factory=list)


class KVConnectorSchedulerBase(ABC):
    """The scheduler's side: decisions only, no bytes moved."""

    @property
    @abstractmethod
    def failure_policy(self) -> FailurePolicy:
        """What a failed pull becomes: the prompt computed here, or the request failed."""

    @abstractmethod
    def add_request(self, req_id: str, params: TransferParams) -> None:
        """A request with transfer parameters arrived."""

    @abstractmethod
    def max_output_tokens(self, params: TransferParams) -> int | None:
        """A cap on the request's output (a producer's prefill stops at its first token)."""

    @abstractmethod
    def is_pull(self, params: TransferParams) -> bool:
        """Whether the parameters ask this engine to pull the prompt's KV."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, params: TransferParams, prompt_token_ids: Sequence[int], num_computed_tokens: int,
        cache_salt: bytes | None = None,
    ) -> int | None:
        """Prompt tokens past the `num_computed_tokens` local hits that a pull will bring.

        0: nothing to pull, compute them here. None: the parameters cannot serve this prompt
        (they name KV computed for another one); the request computes its own, and the core
        counts a fallback. `cache_salt` is the prompt's extra key: with it, the prompt is
        its token ids and that key (a prompt of embeddings has placeholder ids).
        """

    @abstractmethod
    def update_state_after_alloc(
        self, req_id: str, params: TransferParams, block_ids: BlockIdGroups,
        num_computed_tokens: int, num_external_tokens: int,
    ) -> None:
        """Plans the pull into the request's allocated blocks (0 external tokens: none, and
        the producer may let its copy go)."""

    @abstractmethod
    def build_connector_meta(self) -> object:
        """What the worker must start or cancel this step."""

    @abstractmethod
    def get_finished(self, output: object) -> FinishedTransfers:
        """Turns the worker's report into what the scheduler must do."""

    @abstractmethod
    def request_finished(
        self, req_id: str, params: TransferParams, block_ids: BlockIdGroups,
        token_ids: Sequence[int], num_computed_tokens: int, aborted: bool,
        cache_salt: bytes | None = None, encoder_key: bytes | None = None,
        num_encoder_tokens: int = 0,
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request ended. Returns (keep its blocks, parameters to return to the client).
        `cache_salt` as for get_num_new_matched_tokens. An encoder-decoder request that ran
        only its encoder (an encoder pod's) has no self-attention blocks; its cross blocks
        (group 1) are kept for the input `encoder_key` of `num_encoder_tokens` positions (a
        prefill's keeps both groups, and says which input too).

        Kept blocks are freed when a later `get_finished` lists the request in `free`.
        """

    def after_pull(self, params: TransferParams) -> TransferParams:
        """The parameters left once the request's pull is over (done, failed, or not
        taken): None, or an instruction that still stands (hold what this engine computes
        for a remote decode)."""
        return None

    def is_cross_pull(self, params: TransferParams) -> bool:
        """Whether the parameters name an encoder pod's cross-attention blocks to pull."""
        return False

    def check_cross_pull(self, params: TransferParams, encoder_key: bytes,
                         num_encoder_tokens: int) -> str | None:
        """Why the cross blocks the parameters name cannot serve this encoder input (they
        were computed for another), or None."""
        return "this connector moves no cross-attention blocks"

    @property
    @abstractmethod
    def num_pulls_in_flight(self) -> int: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class KVConnectorWorkerBase(ABC):
    """The worker's side: moves bytes into and out of the KV cache on its own thread."""

    @abstractmethod
    def apply(self, meta: object) -> None:
        """Starts and cancels what the scheduler side planned."""

    @abstractmethod
    def get_finished(self) -> object:
        """What ended since the last call (the scheduler side reads it)."""

    @abstractmethod
    def shutdown(self) -> None: ...


@dataclass
class KVConnector:
    """Both sides of one engine's connector, and its counters for the step stats."""

    scheduler: KVConnectorSchedulerBase
    worker: KVConnectorWorkerBase
    # A snapshot of the connector's counters, carried in `SchedulerStats.kv_transfer`.
    stats: Callable[[], Any]

    def start_transfers(self) -> None:
        """Hands the worker the pulls and cancels the scheduler side planned since the last call."""
        self.worker.apply(self.scheduler.build_connector_meta())

    def collect(self) -> FinishedTransfers:
        """The worker's report since the last call, as the scheduler must act on it."""
        return self.scheduler.get_finished(self.worker.get_finished())

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


def start_kv_connector(
    config: Any, kv_cache: Sequence[torch.Tensor] | Any, block_size: int,
    parallel_sizes: tuple[int, int] = (1, 1), agent_name: str | None = None,
) -> KVConnector | None:
    """The connector `config` names, with the engine's cache registered for transfers: this
    process's tensors (one per block group), or (a parallel engine of `parallel_sizes`, as
    (pipeline, tensor)) the transfer agents its executor's workers started, named after
    `agent_name`. None when the config allows no transfer (the engine then runs without one).

    Only the NIXL connector exists; it is imported here, when an engine runs one.
    """
    from kvferry.kvtransfer.connector import start_nixl_connector

    return start_nixl_connector(config, kv_cache, block_size, parallel_sizes, agent_name)
