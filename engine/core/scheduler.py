"""Continuous batching: which requests compute how many tokens this step.

Every step has a token budget (`max_num_batched_tokens`) shared by decodes and prefill
chunks. Running requests are served first, in order; when the pool runs out of blocks the
lowest-priority running request is preempted (its blocks freed, its KV recomputed later).
Waiting requests are admitted next, with their prefix-cache hits, as far as the budget,
`max_num_seqs` and free blocks allow; a prompt larger than what is left is chunked.

After scheduling, each request's `num_computed_tokens` already counts this step's tokens,
so the next step can be planned before this one's tokens are sampled.

Invariant: a block's hash enters the prefix-cache index only in `update_from_output`, once
the step that wrote the block's last slot has run. A request taken back out of a step
(preempted, aborted, or failed with it) therefore never leaves a hash for KV that was not
computed. So that requests with a common prefix arriving together (the `n` completions of
one prompt, a shared system prompt) still compute it once, a waiting request whose next
block is being computed in this step by another request waits one step for it.

A request under a grammar (structured outputs) waits outside the queue while its grammar
compiles (`waiting_for_grammar`), then queues like any other; each step lists the ones that
sample (`grammar_req_ids`), and `update_from_output` advances their grammars.

With async scheduling (`SchedulerConfig.async_scheduling`) the next step is scheduled
before this one is updated: each request a step samples gets an output placeholder, counted
as a known token when the next step is planned (in_flight.py). `update_from_output` then
takes the tokens of requests that are still running or were preempted by the step planned
behind (the token was computed before the preemption, as in the synchronous loop), and
drops those of requests that ended meanwhile: a request that stops at step N never emits
step N+1's token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvferry.engine.config import SchedulerConfig
from kvferry.engine.core.in_flight import (
    InFlightSteps,
    advance_with_placeholders,
    num_known_tokens,
)
from kvferry.engine.core.kv_cache import KVCacheBlock, KVCacheManager
from kvferry.engine.core.kv_connector import KVConnectorSchedulerBase
from kvferry.engine.core.messages import EngineCoreOutput, FinishReason, SchedulerStats
from kvferry.engine.core.remote_kv import RemoteKV
from kvferry.engine.core.request import Request, RequestStatus
from kvferry.engine.core.request_queue import make_request_queue
from kvferry.engine.core.running_plan import plan_running, request_id
from kvferry.engine.core.scheduler_output import (
    CachedRequestData,
    EncoderWork,
    ModelRunnerOutput,
    SchedulerOutput,
    new_request_data,
)
from kvferry.engine.core.step_budget import StepBudget
from kvferry.engine.core.stopping import MinTokensGuard, check_stop
from kvferry.engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns request state transitions and the KV cache manager."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        connector: KVConnectorSchedulerBase | None = None,
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        # Requests whose KV crosses engines; None without a KV connector.
        self.remote = None if connector is None else RemoteKV(connector, kv_cache_manager)
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(config.policy)
        self.running: list[Request] = []
        # Grammars of constrained requests; None: the engine takes no constraints.
        self.structured_output = structured_output
        # Requests whose grammar is compiling, in arrival order (they join `waiting` after).
        self.waiting_for_grammar: list[Request] = []
        # Finished since the last schedule(): the runner drops their rows and any state it
        # keeps for them (ids it never saw are ignored there).
        self.finished_req_ids: set[str] = set()
        self._min_tokens = MinTokensGuard()
        self.num_preemptions = 0
        # Encode-only requests whose cross blocks were all cached: done with this step.
        self._encoded_from_cache: list[Request] = []
        # Set by the first encoder-decoder request: the encoder gauges are worth computing.
        self._serves_encoder = False
        self._step_encoder_tokens = 0
        # Async scheduling and microbatches: the steps scheduled and not yet updated; None
        # in the synchronous loop, where each step is updated before the next is scheduled.
        self.in_flight = (InFlightSteps(kv_cache_manager.enable_caching)
                          if config.async_scheduling or config.max_concurrent_batches > 1
                          else None)
        # Async scheduling plans a decode behind the step sampling its input (the device
        # fills it in); microbatches keep decodes disjoint: a request whose token is in
        # flight waits for it (its placeholder is not a known token then).
        self._plans_on_placeholders = config.async_scheduling

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        room = self.config.max_model_len - request.num_prompt_tokens
        request.max_output_tokens = room if params.max_tokens is None else min(
            room, params.max_tokens
        )
        eos = () if params.ignore_eos else request.eos_token_ids
        request.stop_token_set = frozenset((*eos, *params.stop_token_ids))
        transfer = request.kv_transfer_params
        if transfer is not None:
            if self.remote is None:
                raise ValueError("kv_transfer_params need an engine with KV transfer enabled")
            cap = self.remote.connector.max_output_tokens(transfer)
            if cap is not None:
                request.max_output_tokens = min(request.max_output_tokens, cap)
        self.requests[request.request_id] = request
        self._serves_encoder |= request.encoder is not None
        if self.remote is not None:
            self.remote.add_request(request)
        self._min_tokens.add(request)
        if params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError("structured outputs need an engine with a grammar engine")
            self.structured_output.add_request(request)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(request)
            return
        self.waiting.add(request)

    def admit_compiled_grammars(self) -> list[EngineCoreOutput]:
        """Queues the requests whose grammar is ready; returns the outputs of those whose
        constraint failed to compile (they end with an error)."""
        if not self.waiting_for_grammar:
            return []
        outputs = []
        still_compiling = []
        for request in self.waiting_for_grammar:
            grammar = request.grammar
            assert grammar is not None
            if not grammar.is_compiled:
                still_compiling.append(request)
                continue
            error = grammar.start(request.output_token_ids)
            if error is None:
                request.status = RequestStatus.WAITING
                self.waiting.add(request)
                continue
            request.status = RequestStatus.FINISHED_ERROR
            self._free_request(request)
            outputs.append(EngineCoreOutput(request.request_id, [],
                                            finish_reason=FinishReason.ERROR, error=error))
        self.waiting_for_grammar = still_compiling
        return outputs

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus
    ) -> list[Request]:
        """Finishes (or aborts) requests wherever they are; unknown ids are ignored."""
        assert status.is_finished, status
        finished = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                if not request.encode_only:  # an encode-only request has no place in it
                    self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self.remote.remove_waiting(request)
            elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                self.waiting_for_grammar.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def _free_request(self, request: Request) -> dict[str, Any] | None:
        """Frees a finished request's blocks, unless the KV connector keeps them.

        Returns the `kv_transfer_params` for a remote decode (a producer's finished prefill).
        """
        params = None if self.remote is None else self.remote.request_finished(request)
        if self.remote is None or request.request_id not in self.remote.kept:
            self.kv_cache_manager.free(request)
        # A finished request keeps no tensor alive (kept blocks need only its ids).
        request.prompt_embeds = None
        del self.requests[request.request_id]
        self._min_tokens.discard(request.request_id)
        if request.grammar is not None:
            self.structured_output.remove_request(request)  # type: ignore[union-attr]
        # Always reported, wherever the request was: a request preempted and then aborted
        # while waiting has no row but may still have runner state (its cached state).
        self.finished_req_ids.add(request.request_id)
        return params

    def fail_step(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """Finishes every request of a step that raised, freeing their blocks.

        The step advanced their `num_computed_tokens` for KV that may never have been
        written; nothing of it entered the prefix cache (see the module invariant), so
        dropping the requests leaves the cache and the other requests consistent.
        """
        encoded = [work.req_id for work in scheduler_output.scheduled_encoder_inputs]
        req_ids = [*scheduler_output.num_scheduled_tokens, *encoded]
        if self.in_flight is not None:
            # Steps scheduled behind this one ran meanwhile: a request of this step may have
            # been aborted and its id taken by a new request, which this failure spares.
            step_requests = self.in_flight.pop(scheduler_output).requests
            req_ids = [r for r in req_ids if self.requests.get(r) is step_requests.get(r)]
        # The runner may never have taken the step in (it could not be sent): the requests
        # it told of as finished are told again with the next step, but for ids a new
        # request has taken since.
        self.finished_req_ids.update(
            r for r in scheduler_output.finished_req_ids if r not in self.requests)
        return self.finish_requests(req_ids, RequestStatus.FINISHED_ERROR)

    def has_request(self, req_id: str) -> bool:
        """Whether the id is taken: by an unfinished request, or one whose blocks are kept."""
        return req_id in self.requests or (self.remote is not None and req_id in self.remote.kept)

    def get_num_unfinished_requests(self) -> int:
        num_remote = 0 if self.remote is None else len(self.remote.waiting_for_remote)
        return (len(self.waiting) + len(self.running) + num_remote
                + len(self.waiting_for_grammar))

    def has_unfinished_requests(self) -> bool:
        """Whether steps are needed: requests to compute, or transfers to see through."""
        return self.get_num_unfinished_requests() > 0 or bool(self.remote)

    def has_requests_to_compute(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    # ------------------------------------------------------------------ transfers
    def update_from_kv_connector(self, output: object) -> list[EngineCoreOutput]:
        """Applies the KV worker's report; returns the outputs of requests it ended.

        Ready requests go back to the front of the queue with their pulled tokens computed;
        failed ones recompute (policy `recompute`) or end with an error (`fail`).
        """
        assert self.remote is not None
        outcome = self.remote.update(output)
        for request in reversed(outcome.ready):
            self.waiting.prepend(request)
        outputs = []
        for request, failure in outcome.failed:
            # A failed pull's blocks hold garbage and were never indexed: free them.
            self.kv_cache_manager.free(request)
            if self.remote.failure_policy == "recompute":
                self.remote.num_fallbacks += 1
                request.num_computed_tokens = 0
                request.status = RequestStatus.WAITING
                self.waiting.prepend(request)
                continue
            request.status = RequestStatus.FINISHED_ERROR
            self._free_request(request)
            outputs.append(EngineCoreOutput(
                request.request_id, [], finish_reason=FinishReason.ERROR,
                error=f"pulling the prompt's KV failed ({failure.reason}): {failure.message}",
            ))
        return outputs

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        budget = StepBudget(self.config.max_num_batched_tokens, self.kv_cache_manager.block_size,
                            self.config.max_num_encoder_tokens or 0)
        scheduled_running, preempted = self._schedule_running(budget)
        scheduled_waiting: list[Request] = []
        if not preempted:
            scheduled_waiting = self._schedule_waiting(budget)
        output = self._make_output(scheduled_running, scheduled_waiting, preempted, budget)
        self._step_encoder_tokens = sum(r.num_encoder_tokens for r in budget.encoder_requests)
        if self.in_flight is not None:
            self.in_flight.add(output, budget)
            advance_with_placeholders(budget)
            return output
        for request, num_tokens in zip(budget.requests.values(), budget.scheduled.values()):
            request.num_computed_tokens += num_tokens
        return output

    def _schedule_running(self, budget: StepBudget) -> tuple[list[Request], list[Request]]:
        """Serves running requests in order: planned in bulk unless someone must be preempted."""
        planned = self._plan_running(budget)
        if planned is not None:
            return planned, []
        return self._schedule_running_one_by_one(budget)

    def _plan_running(self, budget: StepBudget) -> list[Request] | None:
        """The common step, planned in bulk; None if blocks ran out (see running_plan)."""
        return plan_running(self._running_to_plan(), self.kv_cache_manager,
                            self.config.max_model_len, budget,
                            placeholders=self._plans_on_placeholders)

    def _running_to_plan(self) -> list[Request]:
        """The running requests a step may compute: all of them, or with microbatches the
        first `max_num_seqs` with tokens to compute (the others' are in flight, or wait for
        the next microbatch: the runner's batch holds `max_num_seqs` rows)."""
        config = self.config
        if config.max_concurrent_batches == 1:
            return self.running
        max_model_len = config.max_model_len
        ready = [r for r in self.running
                 if min(len(r.all_token_ids), max_model_len) > r.num_computed_tokens]
        return ready[:config.max_num_seqs]

    def _schedule_running_one_by_one(
        self, budget: StepBudget
    ) -> tuple[list[Request], list[Request]]:
        scheduled: list[Request] = []
        preempted: list[Request] = []
        max_model_len = self.config.max_model_len
        # Microbatches: each holds at most max_num_seqs rows (see _running_to_plan).
        limit = self.config.max_num_seqs if self.config.max_concurrent_batches > 1 else None
        index = 0
        while index < len(self.running) and budget.tokens > 0:
            if limit is not None and len(scheduled) >= limit:
                break
            request = self.running[index]
            known = (num_known_tokens(request) if self._plans_on_placeholders
                     else len(request.all_token_ids))
            num_new = min(known, max_model_len) - request.num_computed_tokens
            num_new = min(num_new, budget.tokens)
            index += 1
            if num_new <= 0:
                continue
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is None:
                following = self.running[index:]
                new_blocks = self._preempt_until_fits(request, num_new, budget, preempted)
                # Victims may sit before or after this request: go on with the first
                # request after it that is still running (under the priority policy, one
                # that preempted itself may be followed by requests that still fit).
                index = next(
                    (self.running.index(r) for r in following if r.status == RequestStatus.RUNNING),
                    len(self.running),
                )
                if new_blocks is None:
                    continue  # the request preempted itself
            if new_blocks:
                budget.new_block_ids[request.request_id] = [b.block_id for b in new_blocks]
            budget.take(request, num_new)
            scheduled.append(request)
        return scheduled, preempted

    def _preempt_until_fits(
        self, request: Request, num_new: int, budget: StepBudget, preempted: list[Request]
    ) -> list[KVCacheBlock] | None:
        """Preempts others until `request` gets its blocks (None if it preempted itself)."""
        while True:
            victim = self._pick_victim()
            self._preempt(victim, budget)
            preempted.append(victim)
            if victim is request:
                return None
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, budget: StepBudget) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        budget.untake(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _schedule_waiting(self, budget: StepBudget) -> list[Request]:
        scheduled: list[Request] = []
        while self.waiting and budget.tokens > 0:
            if self._num_seqs(budget) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            # Preempted by a schedule behind a step that samples it, it is admitted only
            # after that step's token joined its output (async scheduling: the next
            # schedule; microbatches: once that microbatch is updated).
            if request.num_output_placeholders:
                assert not self._plans_on_placeholders, request.request_id
                break
            is_pulled = request.request_id in self.kv_cache_manager.req_to_blocks
            cross_hits: list[KVCacheBlock] = []
            num_new_cross = 0
            if is_pulled:
                # Its pull succeeded: its blocks hold the pulled tokens' KV.
                hits, num_hit_tokens = [], request.num_computed_tokens
            else:
                if request.encoder is not None and self._pulls_cross(request):
                    parked = self._park_for_cross_pull(request)
                    if parked is None:
                        break  # no room for its cross blocks yet
                    if parked:
                        continue
                if request.encoder is not None:
                    cross = self._plan_cross_blocks(request, budget)
                    if cross is None:
                        break  # its encoder waits for the next step
                    cross_hits, num_new_cross = cross
                    if request.encode_only:
                        if not self._admit_encode_only(request, cross_hits, num_new_cross,
                                                       budget):
                            break
                        continue
                hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
                if self._next_block_in_flight(request, len(hits), budget):
                    break  # it will be a prefix-cache hit next step
                num_external = self._num_external_tokens(request, num_hit_tokens)
                if num_external:
                    if not self._park_for_remote_kv(request, hits, num_hit_tokens, num_external):
                        break
                    continue
            num_new = request.num_tokens - num_hit_tokens
            # Without chunked prefill a prompt runs in one step (add_request made sure it
            # fits one); a preempted request's recompute may be longer, so it is chunked.
            if (
                not self.config.enable_chunked_prefill
                and request.num_preemptions == 0
                and num_new > budget.tokens
            ):
                break
            num_new = min(num_new, budget.tokens)
            # A pulled request's tokens are counted in its num_computed_tokens already.
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new, hits, 0 if is_pulled else num_hit_tokens,
                cross_hits, num_new_cross,
            )
            if new_blocks is None:
                break
            self.waiting.pop()
            if not is_pulled:
                self._record_admission(request, num_hit_tokens)
                if self.remote is not None:
                    self.remote.compute_locally(request)
            if num_new_cross:
                budget.take_encoder(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget.take(request, num_new)
            scheduled.append(request)
        return scheduled

    def _pulls_cross(self, request: Request) -> bool:
        return self.remote is not None and request.kv_transfer_params is not None \
            and self.remote.connector.is_cross_pull(request.kv_transfer_params)

    def _num_seqs(self, budget: StepBudget) -> int:
        """Requests counted against `max_num_seqs`: all running ones, or with microbatches
        those of the one being planned (each microbatch has its own)."""
        if self.config.max_concurrent_batches > 1:
            return len(budget.requests)
        return len(self.running)

    def _park_for_cross_pull(self, request: Request) -> bool | None:
        """An encoder-decoder request whose encoder ran on an encoder pod (and, for a long
        decoder prompt, whose prompt a prefill pod computed): allocates its tables and
        parks it while the pull fills them. Cross blocks cached here are taken, not pulled.
        False when it computes here instead (nothing left to pull, or the params name
        another input: the normal admission then takes the hits or runs the encoder, and
        frees the producer's hold); None when the pool has no room now."""
        assert self.remote is not None and request.encoder_key is not None
        manager = self.kv_cache_manager
        mismatch = self.remote.connector.check_cross_pull(
            request.kv_transfer_params, request.encoder_key, request.num_encoder_tokens)
        if mismatch is not None:
            logger.warning("request %s: %s; running its encoder here", request.request_id,
                           mismatch)
            self.remote.num_fallbacks += 1
            self.remote.drop_pull(request)
            return False
        cross_hits = manager.get_cached_cross_blocks(request)
        # A prefill pod's hold brings the decoder prompt's KV too (an encoder pod's, none).
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        num_external = self.remote.matched_tokens(request, num_hit_tokens)
        if num_external is None:
            return False  # computed for another prompt: dropped, counted
        if cross_hits is not None and num_external == 0:
            # Nothing left to pull: the hold is let go now.
            self.remote.num_cross_cache_hits += 1
            self.remote.drop_pull(request)
            return False
        if manager.allocate_slots(request, num_external, hits, num_hit_tokens,
                                  cross_hits or [],
                                  0 if cross_hits is not None else manager.num_cross_blocks(request)
                                  ) is None:
            return None
        self.waiting.pop()
        self._record_admission(request, num_hit_tokens)
        self.remote.num_cross_cache_hits += cross_hits is not None
        self.remote.park(request, num_hit_tokens, num_external,
                         pulls_cross=cross_hits is None)
        return True

    def _plan_cross_blocks(
        self, request: Request, budget: StepBudget
    ) -> tuple[list[KVCacheBlock], int] | None:
        """An encoder-decoder request's cross table: its cached blocks (the encoder need not
        run), or how many to allocate for its encoder to run this step. None when the encoder
        must wait: the step's encoder budget is spent, or another request encodes the same
        input this step (its blocks are a cache hit next step)."""
        manager = self.kv_cache_manager
        cached = manager.get_cached_cross_blocks(request)
        if cached is not None:
            return cached, 0
        assert request.encoder_key is not None
        if request.num_encoder_tokens > budget.encoder_tokens or (
            manager.enable_caching and (
                request.encoder_key in budget.encoder_keys
                or (self.in_flight is not None and self.in_flight.encodes(request.encoder_key))
            )
        ):
            return None
        return [], manager.num_cross_blocks(request)

    def _admit_encode_only(
        self, request: Request, cross_hits: list[KVCacheBlock], num_new_cross: int,
        budget: StepBudget,
    ) -> bool:
        """A request that only runs its encoder: its cross table, and no batch row. One
        whose cross blocks are cached already is done at once (`update_from_output`)."""
        if self.kv_cache_manager.allocate_slots(request, 0, None, 0, cross_hits,
                                                num_new_cross) is None:
            return False
        self.waiting.pop()
        request.status = RequestStatus.RUNNING
        if num_new_cross:
            budget.take_encoder(request)
        else:
            self._encoded_from_cache.append(request)
        return True

    def _record_admission(self, request: Request, num_hit_tokens: int) -> None:
        self.kv_cache_manager.record_prefix_cache_lookup(request.num_tokens, num_hit_tokens)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        request.num_computed_tokens = num_hit_tokens

    def _num_external_tokens(self, request: Request, num_hit_tokens: int) -> int:
        if self.remote is None or request.kv_transfer_params is None:
            return 0
        return self.remote.num_external_tokens(request, num_hit_tokens)

    def _park_for_remote_kv(
        self, request: Request, hits: list[KVCacheBlock], num_hit_tokens: int, num_external: int
    ) -> bool:
        """Allocates blocks for a request's hits and pulled tokens and parks it for the pull.

        False when the pool cannot hold them (the request stays first in the queue).
        """
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, num_external, hits, num_hit_tokens
        )
        if new_blocks is None:
            return False
        self.waiting.pop()
        self._record_admission(request, num_hit_tokens)
        assert self.remote is not None
        self.remote.park(request, num_hit_tokens, num_external)
        return True

    def _next_block_in_flight(self, request: Request, num_hit_blocks: int, budget: StepBudget) -> bool:
        """Whether another request computes, this step, the first block `request` missed."""
        manager = self.kv_cache_manager
        # A hit never covers the last token (see KVCacheManager.get_computed_blocks).
        if not manager.enable_caching or (
            num_hit_blocks >= (request.num_tokens - 1) // manager.block_size
        ) or request.sampling_params.prompt_logprobs is not None:
            return False  # nothing more to hit (prompt logprobs take no hit at all)
        block_hash = request.block_hashes[num_hit_blocks]
        return budget.computes_block(block_hash) or (
            self.in_flight is not None and self.in_flight.computes_block(block_hash))

    def _make_output(
        self,
        running: list[Request],
        waiting: list[Request],
        preempted: list[Request],
        budget: StepBudget,
    ) -> SchedulerOutput:
        # Invariant: a request scheduled from `running` already has a runner row (it got
        # one the step it was admitted), and one admitted from `waiting` has none (new, or
        # dropped from the runner when it was preempted).
        if preempted:
            running = [r for r in running if r.status == RequestStatus.RUNNING]
        cached = CachedRequestData(
            req_ids=list(map(request_id, running)),
            new_block_ids=budget.new_block_ids,
            num_computed_tokens=[r.num_computed_tokens for r in running],
        )
        manager = self.kv_cache_manager
        get_block_ids, get_cross = manager.get_block_ids, manager.get_cross_block_ids
        new_reqs = [
            new_request_data(r, get_block_ids(r.request_id),
                             None if r.encoder is None else get_cross(r.request_id))
            for r in waiting
        ]
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(budget.scheduled),
            total_num_scheduled_tokens=sum(budget.scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            blocked_stop_token_ids=self._min_tokens.blocked_stop_tokens(budget.scheduled),
            filling_req_ids=list(budget.filling) if self.kv_cache_manager.enable_caching else [],
        )
        structured = self.structured_output
        if structured is not None and structured.num_requests:
            output.grammar_req_ids = structured.sampling_requests(budget.scheduled)
        output.scheduled_encoder_inputs = [
            EncoderWork(r.request_id, r.encoder, get_cross(r.request_id))  # type: ignore[arg-type]
            for r in budget.encoder_requests
        ]
        self.finished_req_ids = set()
        return output

    # ------------------------------------------------------------------ update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Indexes the blocks the step filled, appends sampled tokens, finishes stopped requests.

        Returns one output per request that produced a token this step; a finished one
        carries its finish reason.
        """
        if self.in_flight is not None:
            return self._update_from_output_async(scheduler_output, runner_output)
        self._cache_computed_blocks(scheduler_output, self.requests)
        outputs = self._finish_encoder_step(scheduler_output, self.requests)
        stopped = False
        requests, running = self.requests, RequestStatus.RUNNING
        for req_id, token_id in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = requests.get(req_id)
            if request is None or request.status is not running:
                continue  # aborted while the step ran
            output_ids = request.output_token_ids
            output_ids.append(token_id)
            request.all_token_ids.append(token_id)
            output = EngineCoreOutput(req_id, [token_id])
            outputs.append(output)
            if len(output_ids) == 1:
                output.num_cached_tokens = max(request.num_cached_tokens, 0)
            # Most tokens neither stop nor reach a length cap: one set test, one compare.
            if token_id in request.stop_token_set or len(output_ids) >= request.max_output_tokens:
                status = check_stop(request, token_id)
                if status is not None:
                    request.status = status
                    output.finish_reason = status.finish_reason
                    output.stop_reason = request.stop_reason
                    output.kv_transfer_params = self._free_request(request)
                    stopped = True
        return self._finish_update(outputs, stopped, runner_output, requests)

    def _update_from_output_async(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """`update_from_output` of a step with the next one scheduled already (see the
        module docstring): tokens go to the request objects the step computed, still
        running or preempted by the next schedule, each taking one output placeholder."""
        assert self.in_flight is not None
        step = self.in_flight.pop(scheduler_output)
        requests = step.requests
        self._cache_computed_blocks(scheduler_output, requests,
                                    self.in_flight.num_tokens_after(step))
        outputs = self._finish_encoder_step(scheduler_output, requests)
        stopped = False
        running, preempted = RequestStatus.RUNNING, RequestStatus.PREEMPTED
        for req_id, token_id in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = requests.get(req_id)
            if request is None or (request.status is not running
                                   and request.status is not preempted):
                continue  # ended after the step was scheduled: its token is dropped
            request.num_output_placeholders -= 1
            output_ids = request.output_token_ids
            output_ids.append(token_id)
            request.all_token_ids.append(token_id)
            output = EngineCoreOutput(req_id, [token_id])
            outputs.append(output)
            if len(output_ids) == 1:
                output.num_cached_tokens = max(request.num_cached_tokens, 0)
            if token_id in request.stop_token_set or len(output_ids) >= request.max_output_tokens:
                status = check_stop(request, token_id)
                if status is not None:
                    self._end_taking_tokens(request, status)
                    output.finish_reason = status.finish_reason
                    output.stop_reason = request.stop_reason
                    output.kv_transfer_params = self._free_request(request)
                    stopped = True
        return self._finish_update(outputs, stopped, runner_output, requests)

    def _end_taking_tokens(self, request: Request, status: RequestStatus) -> None:
        """Ends a request that just took a token: running, or (async scheduling) preempted
        and back in the queue; the caller frees it and drops it from `running`."""
        if request.status is RequestStatus.PREEMPTED:
            self.waiting.remove(request)
        request.status = status

    def _finish_update(
        self, outputs: list[EngineCoreOutput], stopped: bool, runner_output: ModelRunnerOutput,
        requests: dict[str, Request],
    ) -> list[EngineCoreOutput]:
        """Grammars, the running list, logprobs and prompt logprobs of an update."""
        structured = self.structured_output
        if structured is not None and structured.num_requests:
            stopped |= self._advance_grammars(outputs)
        if stopped:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        if runner_output.logprobs is not None:
            by_req = dict(zip(runner_output.req_ids, runner_output.logprobs))
            for output in outputs:
                if by_req.get(output.req_id):
                    output.new_logprobs = [by_req[output.req_id]]
        if runner_output.prompt_logprobs:
            self._attach_prompt_logprobs(outputs, runner_output.prompt_logprobs, requests)
        return outputs

    def _advance_grammars(self, outputs: list[EngineCoreOutput]) -> bool:
        """Feeds each constrained request's new token to its grammar; a grammar that is
        complete ends its request ("stop"), one the token breaks ends it with an error.
        Returns whether any request ended."""
        structured = self.structured_output
        assert structured is not None
        ended = False
        for output in outputs:
            request = structured.requests.get(output.req_id)
            if request is None or request.is_finished or not output.new_token_ids:
                continue  # unconstrained, ended by this very token, or sampled nothing
            verdict = structured.accept_token(request, output.new_token_ids[-1])
            if verdict is None:
                continue
            if verdict == "stop":
                self._end_taking_tokens(request, RequestStatus.FINISHED_STOPPED)
                output.grammar_ended = True
            else:
                self._end_taking_tokens(request, RequestStatus.FINISHED_ERROR)
                output.error = verdict
            output.finish_reason = request.status.finish_reason
            output.kv_transfer_params = self._free_request(request)
            ended = True
        return ended
    def _attach_prompt_logprobs(
        self, outputs: list[EngineCoreOutput],
        prompt_logprobs: dict[str, tuple[int, list[list[tuple[int, float, int]]]]],
        requests: dict[str, Request],
    ) -> None:
        """Puts each request's prompt logprobs on its output, or on an output of their own
        for a request that sampled nothing (a prefill chunk before the last)."""
        by_req = {output.req_id: output for output in outputs}
        for req_id, (start, entries) in prompt_logprobs.items():
            output = by_req.get(req_id)
            if output is None:
                request = requests.get(req_id)
                if request is None or request.is_finished:
                    continue
                output = EngineCoreOutput(req_id, [])
                outputs.append(output)
            output.new_prompt_logprobs = entries
            output.prompt_logprobs_start = start

    def _finish_encoder_step(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> list[EngineCoreOutput]:
        """Indexes the cross blocks the step's encoder wrote; ends encode-only requests
        (their cross blocks stay cached, or held by the KV connector)."""
        outputs = []
        done = self._encoded_from_cache
        self._encoded_from_cache = []
        for work in scheduler_output.scheduled_encoder_inputs:
            request = requests.get(work.req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran: its blocks were freed, never indexed
            self.kv_cache_manager.cache_cross_blocks(request)
            if request.encode_only:
                done.append(request)
        for request in done:
            if request.status is not RequestStatus.RUNNING:
                continue
            request.status = RequestStatus.FINISHED_STOPPED
            outputs.append(EngineCoreOutput(
                request.request_id, [], finish_reason=FinishReason.STOP,
                kv_transfer_params=self._free_request(request)))
        return outputs

    def _cache_computed_blocks(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request],
        num_tokens_after: dict[str, int] | None = None,
    ) -> None:
        """Indexes the blocks whose KV the step finished writing (the one place that does).

        `num_tokens_after`: tokens of the steps scheduled after this one (async
        scheduling), which `num_computed_tokens` counts already."""
        running = RequestStatus.RUNNING
        for req_id in scheduler_output.filling_req_ids:
            request = requests.get(req_id)
            # A request preempted or finished since it was scheduled has no blocks left.
            if request is None or request.status is not running:
                continue
            num_computed = request.num_computed_tokens
            if num_tokens_after:
                num_computed -= num_tokens_after.get(req_id, 0)
            self.kv_cache_manager.cache_full_blocks(request, num_computed)

    def make_stats(self) -> SchedulerStats:
        """The scheduler's state after a step, for the engine's statistics."""
        prefix = self.kv_cache_manager.prefix_cache_stats
        stored, evicted = self.kv_cache_manager.block_pool.events.drain()
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=self.get_num_unfinished_requests() - len(self.running),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            num_kv_transfer_fallbacks=0 if self.remote is None else self.remote.num_fallbacks,
            num_waiting_for_remote_kv=(
                0 if self.remote is None else len(self.remote.waiting_for_remote)),
            stored_block_hashes=stored,
            evicted_block_hashes=evicted,
            **self._encoder_stats(),
        )

    def _encoder_stats(self) -> dict[str, int]:
        """Encoder-decoder models' gauges (nothing, and no work, for a decoder-only model)."""
        if not self._serves_encoder:
            return {}
        stored, evicted = self.kv_cache_manager.block_pool.events.drain_cross()
        return {
            "stored_cross_hashes": stored,
            "evicted_cross_hashes": evicted,
            "num_cross_cache_hits": 0 if self.remote is None else self.remote.num_cross_cache_hits,
            "num_waiting_for_encoder": sum(1 for r in self.waiting if r.encoder is not None),
            "num_step_encoder_tokens": self._step_encoder_tokens,
            "num_cross_blocks": self.kv_cache_manager.num_cross_blocks_in_use,
        }

