"""The NIXL connector: the engine's KV connector interface (`kvferry.engine.core.kv_connector`)
implemented over NIXL, the only part of the transfer layer the engine core calls.

Split like vLLM's `KVConnectorBase_V1`: a scheduler side that decides (which tokens of a
new request arrive from a remote pod, which blocks a pull fills, which blocks a finished
prefill keeps) and a worker side (worker.py) that moves bytes (registers the KV cache,
starts pulls, reports them over). What crosses between them is the typed metadata below.
Both live in the engine-core process; they share the producer's lease table, so a hold is
visible to the side channel the moment its params leave the scheduler.

A request on a decode pod, step by step (the scheduler's calls):

1. `add_request` on arrival: the params' signature is checked (a pod with a key acts on
   no params it did not sign: nothing they name is contacted, and the pull fails with
   `bad_signature` or `params_expired` at step 3); then heartbeats keep the producer's
   hold alive while the request queues;
2. `get_num_new_matched_tokens` when it is first scheduled, after local prefix hits: the
   tokens whose KV will be pulled;
3. `update_state_after_alloc` once its blocks are allocated: the pull is planned; the
   request waits for remote KV (holding its blocks, never scheduled);
4. every step `build_connector_meta` -> worker `apply` ... worker `get_finished` ->
   `get_finished` here: `ready` (its KV is in its blocks: add the pulled tokens to
   `num_computed_tokens`, index the blocks in the prefix cache, schedule the rest),
   `failed` (recompute or fail by `config.failure_policy`; the pulled blocks must not be
   indexed), `free` (finished requests whose held blocks may now be freed). Once its
   pull is over the request's params must stop asking for one (set them to None), so a
   later preemption recomputes instead of pulling blocks the producer has freed;
5. `request_finished` when it ends: on a producer, a prefill with `do_remote_decode`
   keeps its blocks under a lease and returns the params for the decode hop, signed with
   the service's key (a decode-role pod holds nothing for another pod).

Block groups: block ids travel as one tuple per group. Group 0 is the decoder's
self-attention cache (prefix hits shorten its pull); other groups (an encoder-decoder's
cross-attention cache) are pulled whole.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from kvferry.engine.core.kv_connector import (
    FinishedTransfers,
    KVConnector,
    KVConnectorSchedulerBase,
    TransferFailure,
)
from kvferry.kvtransfer.auth import ParamsRefusal, check_params, sign_params
from kvferry.kvtransfer.config import FailurePolicy, KVTransferConfig
from kvferry.kvtransfer.heartbeat import LeaseKeeper
from kvferry.kvtransfer.lease import LeaseTable
from kvferry.kvtransfer.metrics import FailureReason, KVTransferMetrics
from kvferry.kvtransfer.params import BlockIdGroups, KVTransferParams, prompt_hash

if TYPE_CHECKING:
    from kvferry.kvtransfer.ranked import RankedBackend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProducerEndpoint:
    """How consumers reach this engine: written into the params it returns."""

    engine_id: str
    # Side channel address as advertised.
    host: str
    port: int
    # This process's NIXL agent (new on every start).
    agent_name: str


@dataclass(frozen=True)
class PullSpec:
    """Scheduler -> worker: fill local blocks from a producer's."""

    req_id: str
    params: KVTransferParams
    # Per group, the local blocks to fill and the producer's blocks they come from,
    # pairwise (equal lengths).
    local_block_ids: BlockIdGroups
    remote_block_ids: BlockIdGroups

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.local_block_ids)


@dataclass
class KVConnectorMetadata:
    """Scheduler -> worker, once per step."""

    # Pulls planned since the last step.
    pulls: list[PullSpec] = field(default_factory=list)
    # Requests that finished while their pull was planned or running.
    cancelled: list[str] = field(default_factory=list)


@dataclass
class KVConnectorOutput:
    """Worker -> scheduler, once per step."""

    # Pulls whose bytes are all in the local blocks.
    finished_pulls: list[str] = field(default_factory=list)
    failed_pulls: dict[str, TransferFailure] = field(default_factory=dict)
    # Cancelled pulls that no longer touch their local blocks.
    cancelled_pulls: list[str] = field(default_factory=list)
    # Producer holds that ended (pulled, freed or expired): those blocks may be freed.
    finished_sends: list[str] = field(default_factory=list)


class KVConnectorScheduler(KVConnectorSchedulerBase):
    """The scheduler's side of the transfer layer."""

    def __init__(
        self,
        config: KVTransferConfig,
        block_size: int,
        endpoint: ProducerEndpoint,
        leases: LeaseTable,
        metrics: KVTransferMetrics,
    ) -> None:
        config.require_may_transfer()
        self.config = config
        self.block_size = block_size
        self.endpoint = endpoint
        self._leases = leases
        self._metrics = metrics
        self._keeper = LeaseKeeper(
            config.heartbeat_s,
            (config.side_channel_connect_timeout_s, config.side_channel_timeout_s),
            metrics, endpoint.agent_name, config.side_channel_auth(),
        )
        # Requests whose params failed the signature check on arrival: never contacted.
        self._untrusted: dict[str, ParamsRefusal] = {}
        self._meta = KVConnectorMetadata()
        # Requests whose pull the worker owns (planned, not yet reported over).
        self._pulling: set[str] = set()
        # Of those, requests that finished meanwhile: their blocks wait for the worker.
        self._finished_while_pulling: set[str] = set()
        # Pulls refused before reaching the worker, reported at the next get_finished.
        self._refused: dict[str, TransferFailure] = {}

    @property
    def failure_policy(self) -> FailurePolicy:
        return self.config.failure_policy

    def max_output_tokens(self, params: KVTransferParams | None) -> int | None:
        """A prefill for a remote decode ends at its first token (vLLM's max_tokens 1)."""
        return 1 if params is not None and params.do_remote_decode else None

    def is_pull(self, params: KVTransferParams | None) -> bool:
        return params is not None and params.do_remote_prefill

    # ------------------------------------------------------------------ consumer
    def add_request(self, req_id: str, params: KVTransferParams | None) -> None:
        """A request arrived; if its KV is remote and its params verify, keep the
        producer's hold alive."""
        if params is None or not params.do_remote_prefill:
            return
        refusal = self._check_signature(req_id, params)
        if refusal is not None:
            self._untrusted[req_id] = refusal
            return
        self._keeper.track(req_id, params)

    def _check_signature(self, req_id: str, params: KVTransferParams) -> ParamsRefusal | None:
        """Why the params must not be acted on (counted and logged), or None.

        An insecure pod (no key) checks nothing, as before keys existed.
        """
        key = self.config.transfer_key
        if key is None:
            return None
        refusal = check_params(params, key, time.time())
        if refusal is not None:
            self._metrics.count_failure(refusal.reason)
            logger.warning("request %s: refusing its kv_transfer_params (%s): %s; nothing they "
                           "name is contacted", req_id, refusal.reason.value, refusal.message)
        return refusal

    def get_num_new_matched_tokens(
        self,
        params: KVTransferParams | None,
        prompt_token_ids: Sequence[int],
        num_computed_tokens: int,
        cache_salt: bytes | None = None,
    ) -> int | None:
        """Tokens past the local prefix hits whose KV a pull will bring (0: compute them;
        None: the held blocks were computed for another prompt, so compute this one here).

        The last prompt token is never pulled: sampling the first output token needs its
        logits, so it is computed here, exactly like a full local prefix-cache hit.
        """
        if params is None or not params.do_remote_prefill:
            return 0
        if not _same_prompt(prompt_token_ids, params, cache_salt):
            logger.warning(
                "its prompt differs from the one request %s held on %s computed; computing "
                "it here", params.remote_request_id, params.remote_engine_id)
            return None
        num_prompt_tokens = len(prompt_token_ids)
        # An encoder pod's hold has none (0); a producer that does not say, all of them.
        held = num_prompt_tokens if params.kvferry_num_tokens is None else params.kvferry_num_tokens
        num_remote = min(held, num_prompt_tokens - 1)
        return max(0, num_remote - num_computed_tokens)

    def update_state_after_alloc(
        self,
        req_id: str,
        params: KVTransferParams | None,
        block_ids: Sequence[Sequence[int]],
        num_computed_tokens: int,
        num_external_tokens: int,
    ) -> None:
        """Plans the pull of a request whose blocks are allocated.

        `block_ids`: the request's whole table per group (prefix hits first);
        `num_computed_tokens`: its local prefix hits (whole blocks); `num_external_tokens`:
        what get_num_new_matched_tokens returned. With 0 external tokens, the producer's
        hold is freed: the request computes everything here.
        """
        if params is None or not params.do_remote_prefill:
            return
        # An encoder pod's hold is pulled into the cross table (group 1) when one is given;
        # without it (or with no tokens to pull otherwise) the request computes here.
        pulls_cross = params.is_cross_pull and len(block_ids) > 1
        refusal = self._refusal_of(req_id, params)
        if refusal is not None:
            # A parked request (a pull planned) hears of it at the next get_finished.
            if num_external_tokens or pulls_cross:
                self._refused[req_id] = TransferFailure(refusal.reason, refusal.message)
            return
        if num_external_tokens == 0 and not pulls_cross:
            self._keeper.release(req_id)
            return
        try:
            spec = self._plan_pull(req_id, params, block_ids, num_computed_tokens,
                                   num_external_tokens)
        except ValueError as e:
            self._keeper.release(req_id)
            self._refused[req_id] = TransferFailure(FailureReason.INVALID_PARAMS, str(e))
            self._metrics.count_failure(FailureReason.INVALID_PARAMS)
            return
        self._pulling.add(req_id)
        self._meta.pulls.append(spec)

    def _refusal_of(self, req_id: str, params: KVTransferParams) -> ParamsRefusal | None:
        """The arrival check's verdict; checked now for a request that skipped arrival."""
        if req_id in self._untrusted:
            return self._untrusted.pop(req_id)
        if self._keeper.is_tracked(req_id):
            return None
        return self._check_signature(req_id, params)

    def _plan_pull(
        self,
        req_id: str,
        params: KVTransferParams,
        block_ids: Sequence[Sequence[int]],
        num_computed_tokens: int,
        num_external_tokens: int,
    ) -> PullSpec:
        if num_computed_tokens % self.block_size:
            raise RuntimeError(
                f"request {req_id}: {num_computed_tokens} computed tokens is not a whole "
                f"number of {self.block_size}-token blocks"
            )
        # Group 0: blocks covering tokens [num_computed, num_computed + num_external).
        first = num_computed_tokens // self.block_size
        end = math.ceil((num_computed_tokens + num_external_tokens) / self.block_size)
        remote = params.remote_block_ids
        if len(block_ids) < len(remote) and not params.is_cross_pull:
            raise ValueError(
                f"the producer sent {len(remote)} block groups, this request has {len(block_ids)}"
            )
        local_groups = [tuple(block_ids[0][first:end])]
        remote_groups = [remote[0][first:end]]
        # Other groups (cross-attention) are pulled whole; an encoder-decoder request whose
        # cross blocks are cached here is given group 0 alone.
        for group in range(1, min(len(remote), len(block_ids))):
            local_groups.append(tuple(block_ids[group]))
            remote_groups.append(remote[group])
        for group, (mine, theirs) in enumerate(zip(local_groups, remote_groups, strict=True)):
            expected = end - first if group == 0 else len(mine)
            if len(mine) != expected or len(theirs) != expected:
                raise ValueError(
                    f"block group {group}: {expected} blocks to pull, {len(mine)} allocated "
                    f"here, {len(theirs)} sent by the producer"
                )
        return PullSpec(req_id, params, tuple(local_groups), tuple(remote_groups))

    def is_cross_pull(self, params: KVTransferParams | None) -> bool:
        return params is not None and params.is_cross_pull

    def after_pull(self, params: KVTransferParams | None) -> KVTransferParams | None:
        return None if params is None else params.without_pull()

    def check_cross_pull(self, params: KVTransferParams, encoder_key: bytes,
                         num_encoder_tokens: int) -> str | None:
        """Why an encoder pod's hold cannot serve this request's encoder input, or None."""
        if params.kvferry_encoder_hash != encoder_key.hex():
            self._metrics.count_failure(FailureReason.INVALID_PARAMS)
            return (f"the cross-attention blocks request {params.remote_request_id} holds on "
                    f"{params.remote_engine_id} were computed for another encoder input")
        if params.kvferry_num_encoder_tokens != num_encoder_tokens:
            self._metrics.count_failure(FailureReason.INVALID_PARAMS)
            return (f"the held cross-attention blocks cover {params.kvferry_num_encoder_tokens} "
                    f"encoder positions, this input has {num_encoder_tokens}")
        return None

    # ------------------------------------------------------------------ each step
    def build_connector_meta(self) -> KVConnectorMetadata:
        """What the worker must start or cancel this step."""
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta

    def get_finished(self, output: KVConnectorOutput) -> FinishedTransfers:
        """Turns the worker's report into what the scheduler must do."""
        done = FinishedTransfers(failed=self._refused)
        self._refused = {}
        for req_id in output.finished_pulls:
            self._pull_succeeded(req_id, done)
        for req_id, failure in output.failed_pulls.items():
            self._pull_over(req_id, done, failure)
        for req_id in output.cancelled_pulls:
            self._pull_over(req_id, done, None)
        done.free.extend(output.finished_sends)
        return done

    def _pull_succeeded(self, req_id: str, done: FinishedTransfers) -> None:
        if self._keeper.is_lost(req_id):
            # The producer dropped the hold mid-read: the bytes may belong to another request.
            failure = TransferFailure(
                FailureReason.LEASE_LOST, f"request {req_id}: the producer's hold ended "
                "before the pull finished")
            self._metrics.count_failure(FailureReason.LEASE_LOST)
            self._pull_over(req_id, done, failure)
            return
        # The producer freed its blocks on the read's notification.
        self._keeper.untrack(req_id)
        self._pulling.discard(req_id)
        if req_id in self._finished_while_pulling:
            self._finished_while_pulling.discard(req_id)
            done.free.append(req_id)
        else:
            done.ready.append(req_id)

    def _pull_over(
        self, req_id: str, done: FinishedTransfers, failure: TransferFailure | None
    ) -> None:
        self._keeper.release(req_id)
        self._pulling.discard(req_id)
        if req_id in self._finished_while_pulling:
            self._finished_while_pulling.discard(req_id)
            done.free.append(req_id)
        elif failure is not None:
            done.failed[req_id] = failure

    # ------------------------------------------------------------------ finish
    def request_finished(
        self,
        req_id: str,
        params: KVTransferParams | None,
        block_ids: Sequence[Sequence[int]],
        token_ids: Sequence[int],
        num_computed_tokens: int,
        aborted: bool,
        cache_salt: bytes | None = None,
        encoder_key: bytes | None = None,
        num_encoder_tokens: int = 0,
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request ended. Returns (keep its blocks, params to return to the client).

        `token_ids`: the request's tokens (prompt and output); the params carry a hash of
        the held ones (and of `cache_salt`, the hash of a prompt given as embeddings), so a
        consumer can tell they were computed for its prompt. Kept
        blocks are freed when a later get_finished lists the request in `free`.
        """
        if req_id in self._pulling:
            # A read may be writing into its blocks: keep them until the worker says it stopped.
            self._finished_while_pulling.add(req_id)
            self._meta.cancelled.append(req_id)
            return True, None
        self._keeper.release(req_id)
        self._refused.pop(req_id, None)
        self._untrusted.pop(req_id, None)
        if params is None or not params.do_remote_decode or aborted:
            return False, None
        if encoder_key is not None and num_computed_tokens == 0 and len(block_ids) > 1:
            return True, self._hold_cross_blocks(req_id, block_ids, encoder_key,
                                                 num_encoder_tokens)
        if num_computed_tokens < 1:
            return False, None
        if self.config.role == "decode":
            # The front end refuses these; a decode pod's blocks are never held for another.
            logger.warning("request %s: a decode pod holds no blocks for do_remote_decode", req_id)
            return False, None
        held = self._hold(req_id, block_ids, num_computed_tokens)
        out = replace(self._params_for_decode(req_id, held, num_computed_tokens),
                      kvferry_prompt_hash=prompt_hash(token_ids[:num_computed_tokens],
                                                      cache_salt))
        if encoder_key is not None:
            # The decoder prompt's KV depends on the encoder input (and the prompt hash, by
            # `cache_salt`, on its key): the consumer checks both before pulling.
            out = replace(out, kvferry_encoder_hash=encoder_key.hex(),
                          kvferry_num_encoder_tokens=num_encoder_tokens)
        if self.config.transfer_key is not None:
            out = sign_params(out, self.config.transfer_key, time.time())
        return True, out.to_dict()

    def _hold_cross_blocks(
        self, req_id: str, block_ids: Sequence[Sequence[int]], encoder_key: bytes,
        num_encoder_tokens: int,
    ) -> dict[str, Any]:
        """An encoder's output: its cross-attention blocks (group 1) held for a decode pod,
        and the params that name them and the input they were computed for."""
        held: BlockIdGroups = ((), tuple(block_ids[1]))
        self._leases.hold(req_id, held)
        out = replace(self._params_for_decode(req_id, held, 0),
                      kvferry_encoder_hash=encoder_key.hex(),
                      kvferry_num_encoder_tokens=num_encoder_tokens)
        if self.config.transfer_key is not None:
            out = sign_params(out, self.config.transfer_key, time.time())
        return out.to_dict()

    def _hold(
        self, req_id: str, block_ids: Sequence[Sequence[int]], num_computed_tokens: int
    ) -> BlockIdGroups:
        num_blocks = math.ceil(num_computed_tokens / self.block_size)
        held = (tuple(block_ids[0][:num_blocks]),) + tuple(tuple(g) for g in block_ids[1:])
        self._leases.hold(req_id, held)
        return held

    def _params_for_decode(
        self, req_id: str, held: BlockIdGroups, num_computed_tokens: int
    ) -> KVTransferParams:
        ep = self.endpoint
        return KVTransferParams(
            do_remote_prefill=True, remote_engine_id=ep.engine_id, remote_host=ep.host,
            remote_port=ep.port, remote_block_ids=held, remote_request_id=req_id,
            kvferry_agent_name=ep.agent_name, kvferry_num_tokens=num_computed_tokens,
            kvferry_lease_s=self._leases.lease_s,
        )

    @property
    def num_pulls_in_flight(self) -> int:
        return len(self._pulling)

    def shutdown(self) -> None:
        self._keeper.close()


def _same_prompt(prompt_token_ids: Sequence[int], params: KVTransferParams,
                 cache_salt: bytes | None) -> bool:
    """Whether the held blocks were computed for this prompt (True if the producer does not
    say: another implementation; the router is trusted then)."""
    if params.kvferry_prompt_hash is None:
        return True
    held = prompt_token_ids[: params.kvferry_num_tokens]
    return prompt_hash(held, cache_salt) == params.kvferry_prompt_hash


def start_nixl_connector(
    config: KVTransferConfig, kv_cache: torch.Tensor | Sequence[torch.Tensor] | RankedBackend,
    block_size: int, parallel_sizes: tuple[int, int] = (1, 1), agent_name: str | None = None,
) -> KVConnector | None:
    """Registers the cache with NIXL and opens the side channel (its port is bound now).
    `kv_cache`: as `KVConnectorWorker.register_kv_caches` takes it, or a parallel engine's
    rank agents (`attach_ranks`), named after `agent_name`.

    None without a key (and not insecure): such a pod takes part in no transfer, so it
    registers no memory and serves no side channel (its front end refuses the params).
    """
    from kvferry.kvtransfer.ranked import RankedBackend
    from kvferry.kvtransfer.worker import KVConnectorWorker

    if not config.may_transfer:
        logger.warning("no KV transfer key: the KV connector is not started")
        return None
    metrics = KVTransferMetrics()
    worker = KVConnectorWorker(config, metrics, agent_name)
    if isinstance(kv_cache, RankedBackend):
        endpoint = worker.attach_ranks(kv_cache, parallel_sizes)
    else:
        endpoint = worker.register_kv_caches(kv_cache)
    scheduler = KVConnectorScheduler(config, block_size, endpoint, worker.leases, metrics)
    return KVConnector(scheduler, worker, metrics.snapshot)
