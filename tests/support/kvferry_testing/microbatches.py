"""Executors that watch the microbatch loop (engine_core._step_microbatches) from the
executor's side: which requests each microbatch computes and samples, which are in flight
together, how many rows each carries, which KV blocks each writes.

`Recorder` is a simulated pipeline (engine/executor/simulated.py) over an executor that
computes at submit; it asserts at every submit what must hold whatever the schedule:

- a request sampling in a microbatch still in flight computes in no other microbatch
  (a prompt's chunks may follow each other; a decode is in one microbatch at a time);
- no microbatch carries more than `max_rows` requests (the runner's batch size);
- with the real model runner: a new request's prefix-cache hits are blocks whose last
  writer has been updated already (scheduler.py's block-hash invariant).

`LatePipeline` computes each step later than its submit, as a real pipeline's stages do.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvferry.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvferry.engine.executor.base import Executor, ExecutorWrapper, InProcessExecutor
from kvferry.engine.executor.simulated import SimulatedPipeline
from kvferry.engine.structured_output.manager import GrammarBitmask

if TYPE_CHECKING:
    from kvferry.engine.core.engine_core import EngineCore


class SampledIds(ExecutorWrapper):
    """Wraps an executor that computes at submit; remembers who the last step sampled and
    (over the real runner) which KV blocks its tokens were written to."""

    def __init__(self, inner: Executor) -> None:
        super().__init__(inner)
        self.last: set[str] = set()
        self.last_written_blocks: set[int] = set()

    def submit(self, scheduler_output: SchedulerOutput,
               grammar_bitmask: Any = None) -> Future[ModelRunnerOutput]:
        future = self.inner.submit(scheduler_output, grammar_bitmask)
        self.last = set(future.result().req_ids) if future.exception() is None else set()
        self.last_written_blocks = set()
        total = scheduler_output.total_num_scheduled_tokens
        if isinstance(self.inner, InProcessExecutor) and total:
            runner = self.inner.runner
            slots = runner.buffers.slot_mapping[:total]
            self.last_written_blocks = set((slots // runner.block_size).tolist())
        return future


class Recorder(ExecutorWrapper):
    """A simulated pipeline over `inner` that checks the loop's invariants at each submit
    (see the module docstring) and records each microbatch's requests.

    `core`: the engine core it serves, for the block-hash check (its scheduler's steps in
    flight); `max_rows`: the most requests a microbatch may carry."""

    def __init__(self, inner: Executor, num_stages: int, stage_seconds: float, *,
                 core: EngineCore | None = None, max_rows: int | None = None) -> None:
        self.sampled = SampledIds(inner)
        self.pipeline = SimulatedPipeline(self.sampled, num_stages, stage_seconds)
        super().__init__(self.pipeline)
        self.core = core
        self.max_rows = max_rows
        self.in_flight: list[tuple[SchedulerOutput, Future[ModelRunnerOutput], set[str]]] = []
        self.submitted: list[dict[str, int]] = []
        self.overlapping_chunks = 0
        self.max_in_flight = 0
        # Requests preempted by a microbatch while one in flight samples their token.
        self.preempted_while_sampling: set[str] = set()
        # Prefix-cache hit blocks whose writer was checked.
        self.num_hit_blocks_checked = 0
        # block id -> the step that last wrote it.
        self._last_writer: dict[int, SchedulerOutput] = {}

    def submit(self, scheduler_output: SchedulerOutput,
               grammar_bitmask: Any = None) -> Future[ModelRunnerOutput]:
        pending = self._pending(scheduler_output)
        self._check_hits(scheduler_output, pending)
        for _, other_sampled in pending:
            self.preempted_while_sampling |= scheduler_output.preempted_req_ids & other_sampled
        future = self.inner.submit(scheduler_output, grammar_bitmask)
        if not scheduler_output.total_num_scheduled_tokens:
            return future
        scheduled = set(scheduler_output.num_scheduled_tokens)
        if self.max_rows is not None:
            assert len(scheduled) <= self.max_rows, (len(scheduled), self.max_rows)
        for other_output, other_sampled in pending:
            # A request computing in two microbatches at once is only a prompt's chunks,
            # and the earlier one samples nothing (an id taken again by a new request
            # after an abort is another request).
            both = {r for r in scheduled & set(other_output.num_scheduled_tokens)
                    if self._same_request(r, other_output, scheduler_output)}
            assert not both & other_sampled, both & other_sampled
            self.overlapping_chunks += len(both)
        sampled = self.sampled.last
        assert not sampled - scheduled
        for block_id in self.sampled.last_written_blocks:
            self._last_writer[block_id] = scheduler_output
        self.in_flight.append((scheduler_output, future, sampled))
        self.max_in_flight = max(self.max_in_flight, len(pending) + 1)
        self.submitted.append(dict(scheduler_output.num_scheduled_tokens))
        return future

    def _pending(self, scheduler_output: SchedulerOutput) -> list[tuple[SchedulerOutput, set[str]]]:
        """The microbatches in flight besides this one, with the requests each samples:
        those the scheduler has not updated (with `core`), else those not delivered."""
        if self.core is None:
            self.in_flight = [entry for entry in self.in_flight if not entry[1].done()]
        else:
            in_flight = self.core.scheduler.in_flight
            assert in_flight is not None
            outputs = [step.output for step in in_flight]
            self.in_flight = [entry for entry in self.in_flight
                              if any(entry[0] is output for output in outputs)]
        return [(output, sampled) for output, _, sampled in self.in_flight
                if output is not scheduler_output]

    def _same_request(self, req_id: str, earlier: SchedulerOutput,
                      later: SchedulerOutput) -> bool:
        """Whether two steps computing `req_id` compute the same request."""
        if self.core is None:
            return True
        in_flight = self.core.scheduler.in_flight
        assert in_flight is not None
        requests = {id(step.output): step.requests for step in in_flight}
        return requests[id(earlier)][req_id] is requests[id(later)][req_id]

    def _check_hits(self, scheduler_output: SchedulerOutput,
                    pending: list[tuple[SchedulerOutput, set[str]]]) -> None:
        """Each new request's cached blocks were written by a step updated already."""
        if self.core is None:
            return
        block_size = self.core.kv_cache_manager.block_size
        for new in scheduler_output.scheduled_new_reqs:
            for block_id in new.block_ids[:new.num_computed_tokens // block_size]:
                writer = self._last_writer.get(block_id)
                assert writer is not None, (new.req_id, block_id, "a hit no step wrote")
                assert all(writer is not output for output, _ in pending), (
                    new.req_id, block_id, "a hit on a block whose step is in flight")
                self.num_hit_blocks_checked += 1

def install_recorder(core: EngineCore, num_stages: int, stage_seconds: float = 0.001,
                     max_rows: int | None = None) -> Recorder:
    """Puts a `Recorder` over the core's own model runner in place of its executor."""
    recorder = Recorder(InProcessExecutor(core.runner), num_stages, stage_seconds, core=core,
                        max_rows=max_rows)
    core.executor = recorder
    return recorder


class LatePipeline(Executor):
    """A pipeline of `num_stages` whose steps are computed when their stages would compute
    them, not at submit: on one worker thread, in submit order, each after a wait of
    `stage_seconds` per stage. It keeps the executor contract a real pipeline keeps
    (engine/executor/pipeline.py): a step's grammar bitmask is copied once filled (the
    next step's fill reuses the buffer), and what is not a step (a failed step's
    recovery, prompt embeddings let go) reaches the runner after the steps submitted
    before it."""

    def __init__(self, inner: Executor, num_stages: int, stage_seconds: float) -> None:
        self.inner = inner
        self.max_concurrent_batches = num_stages
        self.delay = num_stages * stage_seconds
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="late-pipeline")

    def submit(self, scheduler_output: SchedulerOutput,
               grammar_bitmask: GrammarBitmask | None = None) -> Future[ModelRunnerOutput]:
        if grammar_bitmask is not None:
            grammar_bitmask = GrammarBitmask(grammar_bitmask.req_ids,
                                             grammar_bitmask.copy_when_filled())

        def compute() -> ModelRunnerOutput:
            time.sleep(self.delay)
            return self.inner.submit(scheduler_output, grammar_bitmask).result()

        return self._worker.submit(compute)

    def recover_from_failed_step(self, failed_req_ids: list[str]) -> None:
        self._worker.submit(self.inner.recover_from_failed_step, failed_req_ids)

    def release_prompt_embeds(self, req_ids: Iterable[str]) -> None:
        self._worker.submit(self.inner.release_prompt_embeds, list(req_ids))

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True)
        self.inner.shutdown()
