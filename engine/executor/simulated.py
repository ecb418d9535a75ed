"""A pipeline of stages simulated in time, for the microbatch loop's tests and benchmark.

`SimulatedPipeline` computes each step with another executor when it is submitted, then
hands the result back only when a pipeline of `num_stages` stages, each busy `stage_seconds`
per microbatch, would have finished it: microbatch k enters stage s once stage s is done
with k - 1 and k has left stage s - 1. Timings are exact and the machine's own speed does
not blur them (the work is done up front; the wait is a sleep until the step's finish time
when the engine first waits for it), so the loop's overlap is what the figures show. A
step's future is never done before the engine waits for it, however slow the machine: a
test's view of what is in flight does not hang on a thread being scheduled in time. A step with nothing to compute (it only tells the runner which
requests finished) takes no stage time.

`FakeTokens` stands in for a model where only the loop matters: it tracks each request's
known and computed tokens from the scheduler's outputs alone and samples token
`(7 * position + 3) % vocab_size` for every request whose tokens are all computed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from kvferry.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvferry.engine.executor.base import Executor, ExecutorWrapper

if TYPE_CHECKING:
    from kvferry.engine.structured_output.manager import GrammarBitmask


class SimulatedPipeline(ExecutorWrapper):
    """`inner`'s steps, delivered as a pipeline of `num_stages` would deliver them. The
    inner executor computed every step submitted so far: what is not a step reaches it
    after them, as the executor contract asks."""

    def __init__(self, inner: Executor, num_stages: int, stage_seconds: float) -> None:
        if num_stages < 1 or stage_seconds < 0:
            raise ValueError(f"num_stages must be >= 1 and stage_seconds >= 0, got "
                             f"{num_stages} and {stage_seconds}")
        super().__init__(inner)
        self.num_stages = self.max_concurrent_batches = num_stages
        self.stage_seconds = stage_seconds
        # When each stage is free again (monotonic seconds).
        self._stage_free = [0.0] * num_stages
        # Seconds each stage spent on microbatches, and microbatches submitted and in flight.
        self.busy_seconds = [0.0] * num_stages
        self.num_submitted = 0
        self.num_in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def submit(self, scheduler_output: SchedulerOutput,
               grammar_bitmask: GrammarBitmask | None = None) -> Future[ModelRunnerOutput]:
        done = self.inner.submit(scheduler_output, grammar_bitmask)
        if not (scheduler_output.total_num_scheduled_tokens
                or scheduler_output.scheduled_encoder_inputs):
            return done
        finish_at = self._occupy_stages(time.monotonic())
        with self._lock:
            self.num_submitted += 1
            self.num_in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        return _Deferred(done, finish_at, self._delivered)

    def _occupy_stages(self, now: float) -> float:
        """Books the stages for one microbatch entering at `now`; returns when it leaves
        the last one."""
        leaves = now
        for stage in range(self.num_stages):
            enters = max(leaves, self._stage_free[stage])
            leaves = enters + self.stage_seconds
            self._stage_free[stage] = leaves
            self.busy_seconds[stage] += self.stage_seconds
        return leaves

    def _delivered(self) -> None:
        with self._lock:
            self.num_in_flight -= 1

    def stage_busy_seconds(self) -> list[float]:
        return list(self.busy_seconds)


class _Deferred(Future[ModelRunnerOutput]):
    """`source`'s outcome, handed over when first waited for and not before `ready_at`
    (monotonic seconds); `done()` is False until then."""

    def __init__(self, source: Future[ModelRunnerOutput], ready_at: float,
                 on_delivery: Callable[[], None]) -> None:
        super().__init__()
        self._source = source
        self._ready_at = ready_at
        self._on_delivery = on_delivery

    def _deliver(self) -> None:
        if self.done():
            return
        time.sleep(max(0.0, self._ready_at - time.monotonic()))
        error = self._source.exception()
        if error is not None:
            self.set_exception(error)
        else:
            self.set_result(self._source.result())
        self._on_delivery()

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self._deliver()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._deliver()
        return super().exception(timeout)


class FakeTokens(Executor):
    """Samples a token, a function of its position, for each request whose known tokens are
    all computed after the step (no model: for the loop's benchmark)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # req_id -> [known tokens (prompt + sampled), computed tokens]
        self._tokens: dict[str, list[int]] = {}

    def submit(self, scheduler_output: SchedulerOutput,
               grammar_bitmask: GrammarBitmask | None = None) -> Future[ModelRunnerOutput]:
        so = scheduler_output
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._tokens.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self._tokens[new.req_id] = [len(new.token_ids), new.num_computed_tokens]
        cached = so.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            entry = self._tokens.setdefault(req_id, [computed, computed])
            entry[1] = computed
        req_ids, token_ids = [], []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            entry = self._tokens[req_id]
            entry[1] += num_tokens
            if entry[1] >= entry[0]:
                req_ids.append(req_id)
                token_ids.append((7 * entry[0] + 3) % self.vocab_size)
                entry[0] += 1
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=token_ids))
        return future
