"""The pipeline-parallel executor: P worker processes, one per stage, driven by the core.

    core --StepRequest--> stage 0 --(hidden, residual)--> stage 1 ... --> stage P-1
      ^                                                                      |
      +------------------------ StepDone (sampled ids) ----------------------+

`submit(scheduler_output)` hands a microbatch to every stage (each applies its diff to its
own persistent batch) and returns a future at once: the core may submit microbatch k + 1
while k is in a later stage, so stage s works on k while stage s - 1 works on k + 1. Only
the last stage answers; its `ModelRunnerOutput` resolves the microbatch's future.

Threads on the core's side: one sender per worker (a pipe's write never blocks `submit`,
and a step's grammar bitmask, filled while the stages run, is sent to the last stage
when ready) and one reader that waits on every pipe and every process at once. A worker
that dies (killed, out of memory) fails every pending future and every later one at once
with a `PipelineStageError` naming its stage; `shutdown` reaps every process.

Tokens sampled by the last stage reach the stages before it with the next `StepRequest`
(`new_token_ids`), which the core can only submit after reading them: a decode is in at
most one microbatch in flight.

With tensor parallelism (T > 1) each stage is T workers, each holding its shard of the
stage's layers (engine/layers/tensor_parallel.py) and all-reducing within its stage's group;
every worker gets every message, rank t of a stage sends its hidden states to rank t of
the next, and rank 0 of the last stage samples (it alone gets the grammar bitmask), hands
the tokens to its group and answers. Pipeline size 1 with T > 1 is tensor parallelism alone.
A step that fails on some ranks of a group and not others would leave the others waiting
in a collective: only a failure that every rank meets alike (its inputs) or that rank 0
tells the others of (sampling) fails just the step.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import shutil
import signal
import tempfile
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from kvferry.engine.config import CacheConfig, ParallelConfig
from kvferry.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvferry.engine.executor.base import Executor
from kvferry.engine.executor.messages import (
    InitializeKVCache,
    KVCacheReady,
    RecoverFromFailedStep,
    ReleasePromptEmbeds,
    ShutdownStage,
    StageFatal,
    StageReady,
    StageStart,
    StageTiming,
    StepBitmask,
    StepDone,
    StepFailed,
    StepRequest,
)
from kvferry.engine.executor.partition import PipelineStage, pipeline_stages
from kvferry.engine.executor.worker import recv_message, run_worker, send_message
from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.models.loader import check_pipeline_support, check_tensor_parallel_support
from kvferry.engine.runner.model_runner import num_blocks_in_budget

if TYPE_CHECKING:
    from kvferry.engine.structured_output.manager import GrammarBitmask
    from kvferry.kvtransfer.ranked import RankAgentInfo, RankAgentSpec

logger = logging.getLogger(__name__)

# How long `shutdown` waits for workers to exit on their own before it terminates them,
# and then before it kills them.
SHUTDOWN_GRACE_S = 5.0
KILL_GRACE_S = 2.0
# Stage timings the executor keeps (`recent_timings`).
RECENT_TIMINGS = 256


class PipelineStageError(RuntimeError):
    """A pipeline stage failed a microbatch, or is gone (`stage_index`; None when the
    executor itself was shut down)."""

    def __init__(self, stage_index: int | None, message: str) -> None:
        super().__init__(message)
        self.stage_index = stage_index


@dataclass(eq=False)
class _Worker:
    """The core's handle on one stage's process."""

    stage: PipelineStage
    process: BaseProcess
    conn: Connection
    # Its rank in the stage's tensor-parallel group.
    tp_rank: int = 0
    # The pipe of its KV transfer agent's commands and reports.
    transfer_conn: Connection | None = None
    # Pickled messages (or a step and its grammar bitmask) for the sender thread; None
    # stops it.
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    sender: threading.Thread | None = None


class PipelineExecutor(Executor):
    """Runs microbatches over P pipeline stages in worker processes."""

    def __init__(
        self,
        model_dir: Path,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        device: torch.device,
        cache: CacheConfig,
        parallel: ParallelConfig,
        *,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        attention_backend: str = "auto",
        seed: int = 0,
    ) -> None:
        num_stages = parallel.pipeline_parallel_size
        self.tp_size = parallel.tensor_parallel_size
        # Enough microbatches in flight to keep every stage busy.
        self.max_concurrent_batches = num_stages
        check_pipeline_support(arch, num_stages)
        check_tensor_parallel_support(arch, self.tp_size)
        self.stages = pipeline_stages(arch.num_layers, num_stages, parallel.pp_layer_partition)
        self.cache = cache
        devices = stage_devices(device, num_stages * self.tp_size)
        self._transfer_infos: list[RankAgentInfo] = []
        self._rendezvous_dir = tempfile.mkdtemp(prefix="kvferry-pp-")
        self.workers: list[_Worker] = []
        self._lock = threading.Lock()
        # Microbatches submitted and not answered, by step id.
        self._futures: dict[int, Future[ModelRunnerOutput]] = {}
        self._next_step_id = 0
        # Tokens the last stage sampled that the stages before it have not been sent.
        self._unsent_tokens: dict[str, list[int]] = {}
        # Set once a stage is gone or the executor shut down: every future fails with it.
        self._failure: PipelineStageError | None = None
        self._is_shut_down = False
        # Seconds each stage computed (waits for the previous stage excluded), and when it
        # worked on the latest microbatches.
        self._stage_busy_s = [0.0] * num_stages
        self.recent_timings: deque[StageTiming] = deque(maxlen=RECENT_TIMINGS)
        self._reader: threading.Thread | None = None
        # Written at shutdown to wake the reader thread (which waits on it with the pipes).
        self._reader_wakeup, self._wake_reader = get_context("spawn").Pipe(duplex=False)
        try:
            self._start_workers(model_dir, dtype, devices, cache, StageSettings(
                max_num_reqs, max_model_len, max_num_batched_tokens, attention_backend,
                seed, num_threads=max(1, torch.get_num_threads() // len(devices))))
            self.ready: list[StageReady] = self._expect_from_all(StageReady)
        except BaseException:
            self.shutdown()
            raise
        logger.info("pipeline of %d stages of %d tensor-parallel ranks ready: layers %s",
                    num_stages, self.tp_size,
                    [(s.start_layer, s.end_layer) for s in self.stages])

    # ------------------------------------------------------------------ start
    def _start_workers(self, model_dir: Path, dtype: torch.dtype, devices: list[torch.device],
                       cache: CacheConfig, settings: StageSettings) -> None:
        context = get_context("spawn")
        init_method = f"file://{os.path.join(self._rendezvous_dir, 'rendezvous')}"
        backend = "nccl" if devices[0].type == "cuda" else "gloo"
        places = [(stage, tp_rank) for stage in self.stages for tp_rank in range(self.tp_size)]
        for (stage, tp_rank), device in zip(places, devices):
            ours, theirs = context.Pipe(duplex=True)
            # KV transfer commands go apart from the steps (kvtransfer/ranked.py).
            transfer_ours, transfer_theirs = context.Pipe(duplex=True)
            process = context.Process(target=run_worker,
                                      args=(theirs, os.getpid(), transfer_theirs),
                                      name=f"kvferry-pp-stage-{stage.index}-tp-{tp_rank}",
                                      daemon=True)
            process.start()
            theirs.close()
            transfer_theirs.close()
            self.workers.append(_Worker(stage, process, ours, tp_rank, transfer_ours))
            send_message(ours, StageStart(
                stage=stage, model_dir=str(model_dir), dtype=str(dtype).removeprefix("torch."),
                device=str(device), cache=cache, max_num_reqs=settings.max_num_reqs,
                max_model_len=settings.max_model_len,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                attention_backend=settings.attention_backend, seed=settings.seed,
                dist_backend=backend, dist_init_method=init_method,
                num_threads=settings.num_threads,
                gpu_memory_utilization=cache.gpu_memory_utilization,
                log_level=logging.getLogger().getEffectiveLevel(),
                tp_rank=tp_rank, tp_size=self.tp_size,
            ))

    def _expect_from_all(self, kind: type) -> list:
        """Every worker's next message, which must be a `kind`, in the workers' order;
        PipelineStageError as soon as one reports a failure or dies (its neighbours may
        be waiting for it, so every process is watched at once)."""
        answers: dict[int, object] = {}
        conns = {w.conn: i for i, w in enumerate(self.workers)}
        sentinels = {w.process.sentinel: w for w in self.workers}
        while len(answers) < len(self.workers):
            for handle in wait([*conns, *sentinels]):
                if handle in sentinels:
                    worker = sentinels[handle]  # type: ignore[index]
                    worker.process.join(KILL_GRACE_S)
                    raise PipelineStageError(worker.stage.index, _death_message(worker))
                position = conns.pop(handle)  # type: ignore[arg-type]
                answers[position] = self._check_answer(self.workers[position], kind)
        return [answers[i] for i in range(len(self.workers))]

    def _check_answer(self, worker: _Worker, kind: type) -> object:
        index = worker.stage.index
        try:
            message = recv_message(worker.conn)
        except (EOFError, OSError):
            worker.process.join(KILL_GRACE_S)
            raise PipelineStageError(index, _death_message(worker)) from None
        if isinstance(message, StageFatal):
            text = f"pipeline stage {index} failed to start: {message.message}"
            if message.is_refusal:  # a checkpoint or setting it refused, as one process would
                raise ValueError(text)
            raise PipelineStageError(index, text)
        if not isinstance(message, kind):
            raise PipelineStageError(index, f"pipeline stage {index} answered "
                                            f"{message!r:.200} where {kind.__name__} was "
                                            "expected")
        return message

    def num_blocks(self) -> int:
        """KV blocks every stage can hold (the same number on each: a block id means the
        same tokens everywhere): the fewest any stage's budget allows."""
        return min(num_blocks_in_budget(r.block_bytes, self.cache, r.kv_cache_budget)
                   for r in self.ready)

    def initialize_kv_cache(self, num_blocks: int,
                            transfer: Sequence[RankAgentSpec] | None = None) -> None:
        """Allocates every stage's cache, then starts the threads that run steps.

        `transfer`: per worker (rank order), the NIXL agent that registers its cache and
        serves the engine's KV transfers; their pipes and what they report are then
        `transfer_agents()`.
        """
        if transfer is not None and len(transfer) != len(self.workers):
            raise ValueError(f"{len(transfer)} transfer agents for {len(self.workers)} workers")
        for rank, worker in enumerate(self.workers):
            send_message(worker.conn, InitializeKVCache(
                num_blocks, None if transfer is None else transfer[rank]))
        ready: list[KVCacheReady] = self._expect_from_all(KVCacheReady)
        self._transfer_infos = [r.transfer for r in ready if r.transfer is not None]
        for worker in self.workers:
            worker.sender = threading.Thread(
                target=_send_loop, args=(worker,), daemon=True,
                name=f"pp-send-{worker.stage.index}")
            worker.sender.start()
        self._reader = threading.Thread(target=self._read_loop, name="pp-read", daemon=True)
        self._reader.start()

    def transfer_agents(self) -> tuple[list[Connection], list[RankAgentInfo]]:
        """The workers' transfer pipes and agents, in rank order (after `initialize_kv_cache`
        with `transfer`)."""
        conns = [w.transfer_conn for w in self.workers if w.transfer_conn is not None]
        return conns, list(self._transfer_infos)

    # ------------------------------------------------------------------ steps
    def submit(self, scheduler_output: SchedulerOutput,
               grammar_bitmask: GrammarBitmask | None = None) -> Future[ModelRunnerOutput]:
        """Hands one microbatch to the pipeline and returns at once; the future holds the
        last stage's output, or a PipelineStageError."""
        future: Future[ModelRunnerOutput] = Future()
        with self._lock:
            if self._failure is not None:
                future.set_exception(self._failure)
                return future
            if self._reader is None:
                raise RuntimeError("initialize_kv_cache must run before the first step")
            step_id = self._next_step_id
            request = StepRequest(step_id, scheduler_output, self._unsent_tokens,
                                  has_grammar_bitmask=grammar_bitmask is not None)
            try:
                payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 - a microbatch that cannot be sent fails alone
                future.set_exception(RuntimeError(
                    f"microbatch {step_id} cannot be sent to the pipeline stages: "
                    f"{type(exc).__name__}: {exc}"))
                return future
            self._next_step_id += 1
            self._unsent_tokens = {}
            self._futures[step_id] = future
            answering = self._answering_worker
            for worker in self.workers:
                if worker is not answering or grammar_bitmask is None:
                    worker.outbox.put(payload)
                else:  # its rows are copied as soon as they are filled, and sent then
                    worker.outbox.put((payload, step_id, grammar_bitmask.req_ids,
                                       grammar_bitmask.copy_when_filled()))
        return future

    @property
    def _answering_worker(self) -> _Worker:
        """Rank 0 of the last stage: it samples, is sent the grammar bitmasks, answers."""
        return self.workers[-self.tp_size]

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar_bitmask: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """`ModelRunner.execute_model`'s contract: runs one microbatch through every stage
        and waits for it."""
        return self.submit(scheduler_output, grammar_bitmask).result()

    def recover_from_failed_step(self, failed_req_ids: list[str]) -> None:
        """Every stage drops its rows and the failed requests' states (after the
        microbatches already submitted)."""
        self._broadcast(RecoverFromFailedStep(list(failed_req_ids)))

    def release_prompt_embeds(self, req_ids: Iterable[str]) -> None:
        self._broadcast(ReleasePromptEmbeds(list(req_ids)))

    def _broadcast(self, message: object) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._failure is not None:
                return
            for worker in self.workers:
                worker.outbox.put(payload)

    @property
    def num_submitted(self) -> int:
        """Microbatches submitted so far (the next one's step id)."""
        return self._next_step_id

    @property
    def num_in_flight(self) -> int:
        """Microbatches submitted and not answered."""
        with self._lock:
            return len(self._futures)

    # ------------------------------------------------------------------ answers
    def _read_loop(self) -> None:
        """Waits on every stage's pipe and process; resolves futures; fails them all when
        a stage is gone (or this thread fails: no future waits forever)."""
        try:
            self._read_until_stopped()
        except Exception as exc:  # the thread's end must fail what is pending
            logger.exception("the pipeline executor's reader failed")
            self._fail(PipelineStageError(None, f"the pipeline executor's reader failed: "
                                                f"{type(exc).__name__}: {exc}"))

    def _read_until_stopped(self) -> None:
        conns = {w.conn: w for w in self.workers}
        sentinels = {w.process.sentinel: w for w in self.workers}
        while True:
            ready = wait([*conns, *sentinels, self._reader_wakeup])
            if self._reader_wakeup in ready:
                return
            for handle in ready:
                if handle in conns:
                    worker = conns[handle]  # type: ignore[index]
                    try:
                        message = recv_message(worker.conn)
                    except (EOFError, OSError):
                        del conns[handle]  # type: ignore[arg-type]
                        continue  # exiting: its sentinel tells how
                    self._handle(worker, message)
            for handle in ready:
                if handle in sentinels:
                    worker = sentinels[handle]  # type: ignore[index]
                    worker.process.join(KILL_GRACE_S)
                    self._fail(PipelineStageError(worker.stage.index, _death_message(worker)))
                    return

    def _handle(self, worker: _Worker, message: object) -> None:
        if isinstance(message, StageTiming):
            with self._lock:
                self._stage_busy_s[message.stage_index] += message.busy_s
                self.recent_timings.append(message)
        elif isinstance(message, StepDone):
            output = message.output
            with self._lock:
                future = self._futures.pop(message.step_id, None)
                for req_id, token_id in zip(output.req_ids, output.sampled_token_ids):
                    self._unsent_tokens.setdefault(req_id, []).append(token_id)
            if future is not None:
                future.set_result(output)
        elif isinstance(message, StepFailed):
            with self._lock:
                future = self._futures.pop(message.step_id, None)
            if future is not None:
                future.set_exception(PipelineStageError(message.stage_index, (
                    f"pipeline stage {message.stage_index} failed microbatch "
                    f"{message.step_id}: {message.message}")))
        elif isinstance(message, StageFatal):
            self._fail(PipelineStageError(message.stage_index, (
                f"pipeline stage {message.stage_index} failed and exits: {message.message}")))
        else:
            self._fail(PipelineStageError(worker.stage.index, (
                f"pipeline stage {worker.stage.index} sent an unexpected "
                f"{type(message).__name__}")))

    def _fail(self, error: PipelineStageError) -> None:
        """From now on every pending and later microbatch fails with `error`."""
        with self._lock:
            if self._failure is None:
                self._failure = error
                if error.stage_index is not None:
                    logger.error("%s; the pipeline cannot run further steps", error)
            futures, self._futures = self._futures, {}
        for future in futures.values():
            future.set_exception(self._failure)

    @property
    def failure(self) -> PipelineStageError | None:
        """Why the pipeline cannot run (a stage is gone, or it was shut down), or None."""
        return self._failure

    @property
    def fatal_error(self) -> Exception | None:
        return self._failure

    def stage_busy_seconds(self) -> list[float]:
        """Seconds each stage computed microbatches (its waits for the previous stage's
        output excluded), as the stages report them."""
        with self._lock:
            return list(self._stage_busy_s)

    # ------------------------------------------------------------------ stop
    def shutdown(self) -> None:
        """Fails what is pending, stops every worker (terminating, then killing, those
        that do not exit in time) and reaps them. Idempotent."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self._fail(PipelineStageError(None, "the pipeline executor is shut down"))
        stop = pickle.dumps(ShutdownStage(), protocol=pickle.HIGHEST_PROTOCOL)
        for worker in self.workers:
            if worker.sender is not None:
                worker.outbox.put(stop)
                worker.outbox.put(None)
            else:
                _send_quietly(worker.conn, stop)
        _reap([w.process for w in self.workers])
        self._wake_reader.send_bytes(b"stop")
        for thread in [self._reader, *(w.sender for w in self.workers)]:
            if thread is not None:
                thread.join(KILL_GRACE_S)
        for worker in self.workers:
            worker.conn.close()
            if worker.transfer_conn is not None:
                worker.transfer_conn.close()
        self._wake_reader.close()
        self._reader_wakeup.close()
        shutil.rmtree(self._rendezvous_dir, ignore_errors=True)

    def __del__(self) -> None:
        # A safety net for an owner that never calls shutdown: no worker outlives it.
        if not getattr(self, "_is_shut_down", True):
            for worker in self.workers:
                if worker.process.is_alive():
                    worker.process.kill()


@dataclass(frozen=True)
class StageSettings:
    """What every stage is built with, besides its layers and device."""

    max_num_reqs: int
    max_model_len: int
    max_num_batched_tokens: int
    attention_backend: str
    seed: int
    num_threads: int


def stage_devices(device: torch.device, num_workers: int) -> list[torch.device]:
    """Worker w (stage s, tensor-parallel rank t: w = s * T + t) runs on `cuda:w` on GPUs
    (ValueError when fewer are visible), on the CPU otherwise."""
    if device.type != "cuda":
        return [torch.device("cpu")] * num_workers
    visible = torch.cuda.device_count()
    if visible < num_workers:
        raise ValueError(f"pipeline_parallel_size x tensor_parallel_size = {num_workers} "
                         f"needs {num_workers} GPUs, one per worker; {visible} visible")
    return [torch.device("cuda", i) for i in range(num_workers)]


def _send_loop(worker: _Worker) -> None:
    """A worker's sender thread: writes its messages in order; a step with a grammar
    bitmask is followed by the bitmask once it is filled."""
    while True:
        item = worker.outbox.get()
        if item is None:
            return
        try:
            if isinstance(item, bytes):
                worker.conn.send_bytes(item)
                continue
            payload, step_id, req_ids, rows = item
            worker.conn.send_bytes(payload)
            send_message(worker.conn, _filled_bitmask(step_id, req_ids, rows))
        except OSError:
            return  # the worker is gone: the reader reports it


def _filled_bitmask(step_id: int, req_ids: list[str], rows: Future[torch.Tensor]
                    ) -> StepBitmask:
    try:
        return StepBitmask(step_id, list(req_ids), rows.result())
    except Exception as exc:  # noqa: BLE001 - the step fails on the last stage with this text
        return StepBitmask(step_id, list(req_ids), None, f"{type(exc).__name__}: {exc}")


def _send_quietly(conn: Connection, payload: bytes) -> None:
    try:
        conn.send_bytes(payload)
    except OSError:
        pass  # already gone


def _reap(processes: list[BaseProcess]) -> None:
    """Waits for each process to exit; terminates, then kills, the ones that do not."""
    for process in processes:
        process.join(SHUTDOWN_GRACE_S)
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(KILL_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()


def _death_message(worker: _Worker) -> str:
    code = worker.process.exitcode
    pid = worker.process.pid
    if code is None:
        how = "stopped answering"
    elif code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with status {code}"
    rank = f" tensor-parallel rank {worker.tp_rank}" if worker.tp_rank else ""
    return f"pipeline stage {worker.stage.index}{rank} (pid {pid}) {how}"
