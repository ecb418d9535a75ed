"""Continuous batching: which requests compute how many tokens this step.

Every step has a token budget (`max_num_batched_tokens`) shared by decodes and prefill
chunks. Running requests are served first, in order; when the pool runs out of blocks the
lowest-priority running request is preempted (its blocks freed, its KV recomputed later).
Waiting requests are admitted next, with their prefix-cache hits, as far as the budget,
`max_num_seqs` and free blocks allow; a prompt larger than what is left is chunked.

After scheduling, each request's `num_computed_tokens` already counts this step's tokens,
so the next step can be planned before this one's tokens are sampled.
"""

from __future__ import annotations

from kvferry.engine.config import SchedulerConfig
from kvferry.engine.kv_cache import KVCacheManager
from kvferry.engine.request import Request, RequestStatus
from kvferry.engine.request_queue import make_request_queue
from kvferry.engine.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


class Scheduler:
    """Owns request state transitions and the KV cache manager."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(config.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(): the runner drops their rows.
        self.finished_req_ids: set[str] = set()
        # Requests the runner holds a row for, and how many of their block ids it has.
        self._runner_known: set[str] = set()
        self._num_blocks_sent: dict[str, int] = {}

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finishes (or aborts) requests wherever they are; unknown ids are ignored."""
        assert status.is_finished, status
        finished = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._num_blocks_sent.pop(request.request_id, None)
        if request.request_id in self._runner_known:
            self._runner_known.discard(request.request_id)
            self.finished_req_ids.add(request.request_id)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        budget = _Budget(self.config.max_num_batched_tokens)
        scheduled_running, preempted = self._schedule_running(budget)
        scheduled_waiting: list[Request] = []
        if not preempted:
            scheduled_waiting = self._schedule_waiting(budget)
        output = self._make_output(scheduled_running, scheduled_waiting, preempted, budget)
        for req_id, num_tokens in budget.scheduled.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        return output

    def _schedule_running(self, budget: _Budget) -> tuple[list[Request], list[Request]]:
        scheduled: list[Request] = []
        preempted: list[Request] = []
        index = 0
        while index < len(self.running) and budget.tokens > 0:
            request = self.running[index]
            num_preempted = len(preempted)
            num_new = self._num_new_tokens(request, budget.tokens)
            if num_new > 0 and not self._allocate_or_preempt(request, num_new, budget, preempted):
                break  # the request preempted itself: nothing after it can run
            if num_new > 0:
                budget.take(request, num_new)
                scheduled.append(request)
            # Preempting an earlier request (priority policy) shifts this one left.
            index = index + 1 if len(preempted) == num_preempted else self.running.index(request) + 1
        return scheduled, preempted

    def _allocate_or_preempt(
        self, request: Request, num_new: int, budget: _Budget, preempted: list[Request]
    ) -> bool:
        """Allocates blocks for `request`, preempting others until it fits (False if it can't)."""
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            victim = self._pick_victim()
            self._preempt(victim, budget)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _num_new_tokens(self, request: Request, budget_tokens: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        # Never compute past max_model_len (the last token of a full sequence is not fed).
        num_new = min(num_new, self.config.max_model_len - request.num_computed_tokens)
        return max(0, min(num_new, budget_tokens))

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, budget: _Budget) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        budget.untake(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._runner_known.discard(request.request_id)
        self._num_blocks_sent.pop(request.request_id, None)
        self.waiting.prepend(request)

    def _schedule_waiting(self, budget: _Budget) -> list[Request]:
        scheduled: list[Request] = []
        while self.waiting and budget.tokens > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if not self.config.enable_chunked_prefill and num_new > budget.tokens:
                break
            num_new = min(num_new, budget.tokens)
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new, hits, num_hit_tokens
            )
            if new_blocks is None:
                break
            self.waiting.pop()
            self.kv_cache_manager.record_prefix_cache_lookup(request.num_tokens, num_hit_tokens)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget.take(request, num_new)
            scheduled.append(request)
        return scheduled

    def _make_output(
        self,
        running: list[Request],
        waiting: list[Request],
        preempted: list[Request],
        budget: _Budget,
    ) -> SchedulerOutput:
        new_reqs, cached = [], CachedRequestData()
        for request in running + waiting:
            if request.status != RequestStatus.RUNNING:
                continue  # preempted later in the same step
            req_id = request.request_id
            if req_id in self._runner_known:
                num_sent = self._num_blocks_sent[req_id]
                cached.req_ids.append(req_id)
                cached.new_block_ids.append(self.kv_cache_manager.get_block_ids(req_id, num_sent))
                cached.num_computed_tokens.append(request.num_computed_tokens)
            else:
                block_ids = self.kv_cache_manager.get_block_ids(req_id)
                new_reqs.append(_new_request_data(request, block_ids))
                self._runner_known.add(req_id)
            self._num_blocks_sent[req_id] = self.kv_cache_manager.get_num_blocks(req_id)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(budget.scheduled),
            total_num_scheduled_tokens=sum(budget.scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            blocked_stop_token_ids=self._blocked_stop_tokens(budget.scheduled),
        )
        self.finished_req_ids = set()
        return output

    def _blocked_stop_tokens(self, scheduled: dict[str, int]) -> dict[str, list[int]]:
        blocked = {}
        for req_id in scheduled:
            request = self.requests[req_id]
            params = request.sampling_params
            if request.num_output_tokens < params.min_tokens:
                eos = () if params.ignore_eos else request.eos_token_ids
                blocked[req_id] = [*eos, *(params.stop_token_ids or [])]
        return blocked

    # ------------------------------------------------------------------ update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[tuple[Request, list[int]]]:
        """Appends sampled tokens and finishes requests that hit a stop condition.

        Returns (request, new token ids) for each request that produced a token this step;
        finished requests carry their final status.
        """
        updates = []
        for req_id, token_id in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                self.running.remove(request)
                request.status = status
                self._free_request(request)
            updates.append((request, [token_id]))
        return updates

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        # Length first: no stop condition, min_tokens included, may run past max_model_len.
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_output_tokens < params.min_tokens:
            return None
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def make_stats(self) -> tuple[int, int, float]:
        """(running, waiting, KV cache usage) for the engine's statistics."""
        return len(self.running), len(self.waiting), self.kv_cache_manager.usage


def _new_request_data(request: Request, block_ids: list[int]) -> NewRequestData:
    return NewRequestData(
        req_id=request.request_id,
        token_ids=list(request.all_token_ids),
        num_prompt_tokens=request.num_prompt_tokens,
        sampling_params=request.sampling_params,
        block_ids=block_ids,
        num_computed_tokens=request.num_computed_tokens,
    )


class _Budget:
    """The step's token budget and what has been taken from it."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.scheduled: dict[str, int] = {}

    def take(self, request: Request, num_tokens: int) -> None:
        self.tokens -= num_tokens
        self.scheduled[request.request_id] = num_tokens

    def untake(self, request: Request) -> None:
        self.tokens += self.scheduled.pop(request.request_id, 0)
