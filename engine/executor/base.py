"""The executor interface the engine core submits microbatches to.

The engine core schedules a step (a microbatch) and hands it to an executor with `submit`,
which returns at once with a future of the step's `ModelRunnerOutput`. An executor of a
pipeline of P stages keeps up to P microbatches in flight (`max_concurrent_batches`): the
core submits microbatch k + 1 while stage s still works on k (core/engine_core.py). The
in-process executor runs the step at once, so the same loop is the synchronous one.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from kvferry.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from kvferry.engine.runner.model_runner import ModelRunner
    from kvferry.engine.structured_output.manager import GrammarBitmask


class Executor(ABC):
    """Runs scheduled steps and hands back their sampled tokens."""

    # Microbatches that may be in flight at once (a pipeline's number of stages).
    max_concurrent_batches: int = 1

    @abstractmethod
    def submit(self, scheduler_output: SchedulerOutput,
               grammar_bitmask: GrammarBitmask | None = None) -> Future[ModelRunnerOutput]:
        """Starts the step; its future resolves to the step's output, or to the exception
        that failed it. Steps complete in the order they were submitted. The core fills
        the next step's `grammar_bitmask` into the same buffer: an executor that samples
        after later steps were submitted keeps `grammar_bitmask.copy_when_filled()`."""

    def shutdown(self) -> None:
        """Stops whatever the executor started (processes, threads)."""

    def stage_busy_seconds(self) -> list[float]:
        """Seconds each stage has spent computing steps so far (empty: not measured)."""
        return []

    # What is not a step takes effect after the steps submitted before it, as if it came
    # with the next one: microbatches in flight may still compute a failed step's
    # requests, or a prompt of embeddings its request was aborted during.
    def recover_from_failed_step(self, failed_req_ids: list[str]) -> None:
        """After a step failed: its requests are gone and every batch row is dropped (the
        others are rebuilt when next scheduled), as `ModelRunner.recover_from_failed_step`."""

    def release_prompt_embeds(self, req_ids: Iterable[str]) -> None:
        """Lets go of the prompt embeddings held for finished requests."""

    @property
    def fatal_error(self) -> Exception | None:
        """Why no further step can run (a pipeline stage is gone), or None."""
        return None


class InProcessExecutor(Executor):
    """The model runner of this process: a step runs when it is submitted."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._busy_seconds = 0.0

    def submit(self, scheduler_output: SchedulerOutput,
               grammar_bitmask: GrammarBitmask | None = None) -> Future[ModelRunnerOutput]:
        future: Future[ModelRunnerOutput] = Future()
        start = time.perf_counter()
        try:
            future.set_result(self.runner.execute_model(scheduler_output, grammar_bitmask))
        except Exception as exc:  # noqa: BLE001 - the step's failure travels in its future
            future.set_exception(exc)
        self._busy_seconds += time.perf_counter() - start
        return future

    def stage_busy_seconds(self) -> list[float]:
        return [self._busy_seconds]

    def recover_from_failed_step(self, failed_req_ids: list[str]) -> None:
        self.runner.recover_from_failed_step(failed_req_ids)

    def release_prompt_embeds(self, req_ids: Iterable[str]) -> None:
        self.runner.release_prompt_embeds(req_ids)


class ExecutorWrapper(Executor):
    """An executor over `inner`, to which it passes what is not a step as it comes (for
    an `inner` that computes at submit, that is after the steps submitted before).
    Subclasses change how steps are submitted or delivered."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.max_concurrent_batches = inner.max_concurrent_batches

    def submit(self, scheduler_output: SchedulerOutput,
               grammar_bitmask: GrammarBitmask | None = None) -> Future[ModelRunnerOutput]:
        return self.inner.submit(scheduler_output, grammar_bitmask)

    def recover_from_failed_step(self, failed_req_ids: list[str]) -> None:
        self.inner.recover_from_failed_step(failed_req_ids)

    def release_prompt_embeds(self, req_ids: Iterable[str]) -> None:
        self.inner.release_prompt_embeds(req_ids)

    @property
    def fatal_error(self) -> Exception | None:
        return self.inner.fatal_error

    def stage_busy_seconds(self) -> list[float]:
        return self.inner.stage_busy_seconds()

    def shutdown(self) -> None:
        self.inner.shutdown()
