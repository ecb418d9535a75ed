"""AsyncLLM: the server's engine, an asyncio front end over an engine core in its own process.

It is `LLMEngine`'s two-process twin. The same `InputProcessor` (tokenize, validate against
the core's limits, fan `n` out into sequences) and `OutputProcessor` (detokenize, stop
strings, fan in) run here, in the server's process; the core (engine/frontend/core_process.py) runs
the model in another, so HTTP work and detokenization overlap with model steps.

What crosses: each validated sequence goes to the core as an `AddRequest`; the core answers
once per step with the step's new tokens and a `SchedulerStats` snapshot. A request that
fails validation raises here and never reaches the core. One asyncio task reads the core's
outputs, feeds the `OutputProcessor` (DELTA outputs: only what is new), aborts in the core
the sequences a stop string ended, calls the stats listeners, and puts each request's
outputs on its own queue, from which `generate()` yields them.

Death: a task awaits the core process's exit (engine/frontend/core_client.py). When the core ends
without being asked to, every request in flight and every new one fails with
`EngineDeadError` at once, and the dead listeners are told (the server exits non-zero so
that Kubernetes restarts the pod).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvferry.engine.config import EngineConfig
from kvferry.engine.core.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreStepOutputs,
    EngineCoreInfo,
    FinishReason,
    SchedulerStats,
)
from kvferry.engine.frontend.core_client import CoreClient, EngineDeadError
from kvferry.engine.frontend.input_processor import InputProcessor, ProcessedPrompt, PromptType
from kvferry.engine.frontend.output_processor import (
    OutputProcessor,
    RequestOutputKind,
    make_parent_state,
)
from kvferry.engine.frontend.outputs import RequestOutput
from kvferry.engine.frontend.stats import IterationStats
from kvferry.engine.frontend.tokenizer import Tokenizer
from kvferry.engine.models.source import resolve_model_source
from kvferry.engine.sampling_params import SamplingParams
from kvferry.kvtransfer.admission import TransferAdmission
from kvferry.kvtransfer.params import KVTransferParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "QueueFullError", "StatsListener", "merge_deltas"]

# Called once per core step's outputs, in the front end's event loop (the metrics hook).
StatsListener = Callable[[SchedulerStats, IterationStats], None]
# Called once when the engine dies, with the error every request failed with.
DeadListener = Callable[[EngineDeadError], None]


# How often wait_until_idle looks again; a drain lasts seconds, so this costs nothing.
_IDLE_POLL_INTERVAL_S = 0.05


class QueueFullError(RuntimeError):
    """More requests are waiting in the engine core than `max_num_waiting` allows."""


class AsyncLLM:
    """Tokenizer, input and output processing here; the engine core in its own process.

    Build it with `await AsyncLLM.create(config)`; stop it with `await shutdown()`.
    """

    def __init__(
        self,
        config: EngineConfig,
        client: CoreClient,
        info: EngineCoreInfo,
        tokenizer: Tokenizer,
        max_num_waiting: int | None = None,
    ) -> None:
        self.config = config
        self.info = info
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(tokenizer, info,
                                              TransferAdmission(config.kv_transfer))
        self.output_processor = OutputProcessor(tokenizer)
        self.served_model_name = config.model.served_model_name or config.model.model
        self.max_num_waiting = max_num_waiting
        # The latest snapshot the core sent (after its latest step).
        self.scheduler_stats = SchedulerStats()
        self._client = client
        # Request id -> the outputs (or the error) its generate() has yet to hand out.
        self._queues: dict[str, asyncio.Queue[RequestOutput | EngineDeadError]] = {}
        self._stats_listeners: list[StatsListener] = []
        self._dead_listeners: list[DeadListener] = []
        self._dead_error: EngineDeadError | None = None
        self._is_shut_down = False
        # Sequences sent, and received according to the core: the difference is in the socket.
        self._num_sequences_sent = 0
        self._num_sequences_received = 0
        # Finishes by abort between two steps, reported with the next step's stats.
        self._pending_stats = IterationStats()
        self._output_task = asyncio.create_task(self._run_output_loop(), name="core-outputs")
        client.watch_exit(self._on_core_exit)

    @classmethod
    async def create(cls, config: EngineConfig, *, max_num_waiting: int | None = None) -> AsyncLLM:
        """Starts the engine-core process and waits until it has loaded the model.

        Raises EngineDeadError, with the core's error text, if loading fails or the process
        dies first.
        """
        if max_num_waiting is not None and max_num_waiting < 0:
            raise ValueError(f"max_num_waiting must be >= 0, got {max_num_waiting}")
        client = await CoreClient.start(config)
        try:
            info = await client.wait_until_ready()
            tokenizer = await asyncio.to_thread(_load_tokenizer, config, info)
        except BaseException:
            await client.shutdown()
            raise
        return cls(config, client, info, tokenizer, max_num_waiting)

    # ------------------------------------------------------------------ state
    @property
    def is_ready(self) -> bool:
        """Loaded, alive and not shut down: requests are served."""
        return self._dead_error is None and not self._is_shut_down

    @property
    def is_dead(self) -> bool:
        """The engine core died (or its outputs could not be read); nothing is served."""
        return self._dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine died, once it has."""
        return self._dead_error

    @property
    def core_pid(self) -> int | None:
        """The engine-core process's pid."""
        return self._client.pid

    def num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def num_waiting_sequences(self) -> int:
        """Sequences waiting in the core by its latest stats, plus those still in the socket."""
        in_socket = self._num_sequences_sent - self._num_sequences_received
        return self.scheduler_stats.num_waiting_reqs + in_socket

    def add_stats_listener(self, listener: StatsListener) -> None:
        """Calls `listener(scheduler_stats, iteration_stats)` once per core step's outputs."""
        self._stats_listeners.append(listener)

    def add_dead_listener(self, listener: DeadListener) -> None:
        """Calls `listener(error)` once if the engine core dies (not on shutdown)."""
        self._dead_listeners.append(listener)

    # ------------------------------------------------------------------ requests
    async def generate(
        self,
        request_id: str,
        prompt: PromptType | ProcessedPrompt,
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        kv_transfer_params: dict[str, Any] | KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields DELTA outputs of one request; the last has `finished=True`.

        Raises ValueError (invalid input), QueueFullError or EngineDeadError before the
        first output, and EngineDeadError if the core dies mid-request. When the caller
        stops iterating (aclose, cancellation), the request is aborted in the core at once.
        """
        queue = self._add_request(
            request_id, prompt, params, priority, arrival_time, kv_transfer_params
        )
        is_finished = False
        try:
            while True:
                item = _take_merged(await queue.get(), queue)
                if isinstance(item, EngineDeadError):
                    is_finished = True
                    raise EngineDeadError(*item.args)
                is_finished = item.finished
                yield item
                if is_finished:
                    return
        finally:
            if not is_finished:
                self._abort([request_id])

    async def abort(self, request_id: str) -> None:
        """Aborts a request wherever it is; its blocks are freed at once. Unknown ids are
        ignored. Its generate() ends with a final output whose finish reason is "abort"."""
        self._abort([request_id])

    def _add_request(
        self,
        request_id: str,
        prompt: PromptType | ProcessedPrompt,
        params: SamplingParams,
        priority: int,
        arrival_time: float | None,
        kv_transfer_params: dict[str, Any] | KVTransferParams | None = None,
    ) -> asyncio.Queue[RequestOutput | EngineDeadError]:
        self._check_serving()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, ProcessedPrompt):
            # Built by the caller: checked here too, so that it never reaches the core invalid.
            self.input_processor.check_processed(prompt)
            processed = prompt
        else:
            processed = self.input_processor.process_prompt(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        core_requests = self.input_processor.make_requests(
            request_id, processed, params, arrival, priority, kv_transfer_params
        )
        self._check_queue_room()
        self.output_processor.add_request(make_parent_state(
            self.tokenizer, request_id, processed.prompt, processed.prompt_token_ids,
            {r.req_id: r.sampling_params for r in core_requests}, arrival,
            RequestOutputKind.DELTA, processed.num_tokens, processed.encoder,
        ))
        queue: asyncio.Queue[RequestOutput | EngineDeadError] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            for request in core_requests:
                self._client.send(AddRequest(request))
                self._num_sequences_sent += 1
        except EngineDeadError:
            # The core is gone and its exit not yet seen: forget the request, fail it now.
            self._queues.pop(request_id, None)
            self.output_processor.abort([request_id])
            raise
        return queue

    def _check_serving(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(*self._dead_error.args)
        if self._is_shut_down:
            raise EngineDeadError("the engine is shut down")

    def _check_queue_room(self) -> None:
        if self.max_num_waiting is None:
            return
        num_waiting = self.num_waiting_sequences()
        if num_waiting >= self.max_num_waiting:
            raise QueueFullError(
                f"{num_waiting} requests are waiting for the engine, at or past the limit of "
                f"{self.max_num_waiting}; retry later"
            )

    def _abort(self, request_ids: list[str]) -> None:
        child_ids = [c for r in request_ids for c in self.output_processor.child_ids(r)]
        if child_ids and self.is_ready:
            self._send_abort(child_ids, FinishReason.ABORT)
        for output in self.output_processor.abort(request_ids, self._pending_stats):
            queue = self._queues.pop(output.request_id, None)
            if queue is not None:
                queue.put_nowait(output)

    def _send_abort(self, child_ids: list[str], reason: FinishReason) -> None:
        try:
            self._client.send(AbortRequests(child_ids, reason))
        except EngineDeadError:
            logger.warning("abort of %s not sent: the engine core is gone", child_ids)

    # ------------------------------------------------------------------ outputs
    async def _run_output_loop(self) -> None:
        try:
            while True:
                message = await self._client.recv()
                if isinstance(message, CoreStepOutputs):
                    self._process_step(message)
                elif isinstance(message, CoreFailed):
                    self._die(f"the engine core failed: {message.message}")
                    return
                # A recv that finds a message waiting does not yield: let the consumers and
                # HTTP handlers run between steps even when the core is ahead.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - boundary: fail requests rather than hang them
            logger.exception("reading the engine core's outputs failed")
            self._die(f"reading the engine core's outputs failed: {type(exc).__name__}: {exc}")

    def _process_step(self, message: CoreStepOutputs) -> None:
        core_outputs = message.outputs
        iteration, self._pending_stats = self._pending_stats, IterationStats()
        self._num_sequences_received = message.num_requests_received
        processor = self.output_processor
        processor.record_queue_times(core_outputs.queue_times, iteration)
        outputs, stopped = processor.process_outputs(core_outputs.outputs, iteration)
        if stopped:
            # The core cannot see text: free the sequences a stop string ended.
            self._send_abort(stopped, FinishReason.STOP)
        for output in outputs:
            self._route(output)
        self.scheduler_stats = core_outputs.scheduler_stats
        self._notify_stats(iteration)

    def _route(self, output: RequestOutput) -> None:
        if output.finished:
            queue = self._queues.pop(output.request_id, None)
        else:
            queue = self._queues.get(output.request_id)
        if queue is not None:
            queue.put_nowait(output)

    def _notify_stats(self, iteration: IterationStats) -> None:
        for listener in self._stats_listeners:
            try:
                listener(self.scheduler_stats, iteration)
            except Exception:  # noqa: BLE001 - a metrics hook must not stop the outputs
                logger.exception("stats listener %r failed", listener)

    # ------------------------------------------------------------------ death and shutdown
    def _on_core_exit(self) -> None:
        if not self._is_shut_down:
            self._die(f"the engine core process {self._client.describe_exit()}")

    def _die(self, reason: str) -> None:
        """Fails every request in flight, refuses new ones, tells the dead listeners."""
        if self._dead_error is not None or self._is_shut_down:
            return
        error = EngineDeadError(reason)
        self._dead_error = error
        logger.error("engine dead: %s; failing %d requests", reason, len(self._queues))
        self._fail_all(error)
        for listener in self._dead_listeners:
            try:
                listener(error)
            except Exception:  # noqa: BLE001 - every listener must hear it
                logger.exception("dead listener %r failed", listener)

    def _fail_all(self, error: EngineDeadError) -> None:
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            queue.put_nowait(error)
        self.output_processor = OutputProcessor(self.tokenizer)

    async def wait_until_idle(self, timeout_s: float) -> bool:
        """Waits until no request is in flight (a drain); False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.output_processor.parents and not self.is_dead:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_IDLE_POLL_INTERVAL_S)
        return True

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stops the core process (asks, then terminates, then kills) and closes the sockets.

        Requests still in flight fail with EngineDeadError; to drain, wait for them first.
        """
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self._output_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._output_task
        await self._client.shutdown(timeout_s)
        self._fail_all(EngineDeadError("the engine was shut down"))


def _take_merged(
    item: RequestOutput | EngineDeadError,
    queue: asyncio.Queue[RequestOutput | EngineDeadError],
) -> RequestOutput | EngineDeadError:
    """`item` merged with the deltas queued behind it, so that a consumer that fell behind
    (a slow client) catches up in one output instead of one per step."""
    while isinstance(item, RequestOutput) and not queue.empty():
        later = queue.get_nowait()
        if isinstance(later, EngineDeadError):
            return later
        item = merge_deltas(item, later)
    return item


def merge_deltas(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One DELTA output holding what `earlier` and then `later` (of one request) added."""
    merged = {c.index: c for c in earlier.outputs}
    for completion in later.outputs:
        before = merged.get(completion.index)
        if before is None:
            merged[completion.index] = completion
            continue
        before.text += completion.text
        before.token_ids = before.token_ids + completion.token_ids
        if before.logprobs is not None and completion.logprobs is not None:
            before.logprobs = before.logprobs + completion.logprobs
        before.cumulative_logprob = completion.cumulative_logprob
        before.finish_reason = completion.finish_reason
        before.stop_reason = completion.stop_reason
    later.outputs = sorted(merged.values(), key=lambda c: c.index)
    return later


def _load_tokenizer(config: EngineConfig, info: EngineCoreInfo) -> Tokenizer:
    tokenizer_dir = config.model.tokenizer
    source = resolve_model_source(tokenizer_dir) if tokenizer_dir else info.model_dir
    return Tokenizer.from_pretrained(source)
