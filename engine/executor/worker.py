"""A pipeline stage's worker process: join the process group, load the stage (with tensor
parallelism, this rank's shard of it), then run the messages of the core in order
(messages.py) until told to stop.

Only the last stage answers steps. A step that fails on this stage, or upstream, is
answered by the last stage with `StepFailed` and the worker goes on; anything else that
goes wrong (the model does not load, a neighbour is gone, the stages are out of step)
ends the worker with `StageFatal` as its last word. A worker whose parent (the engine
core) is gone exits within a second, so no orphan keeps the model's memory.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
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
from kvferry.engine.executor.partition import PipelineStage
from kvferry.engine.executor.stage_runner import StageRunner, StageStepFailed
from kvferry.engine.layers.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from kvferry.kvtransfer.ranked import RankAgentInfo, RankAgentSpec

logger = logging.getLogger(__name__)

# How often a worker checks that the engine core that started it still exists.
PARENT_CHECK_INTERVAL_S = 1.0


def send_message(conn: Connection, message: object) -> None:
    """Pickles with the standard pickler: tensors travel by value, not as shared memory."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv_message(conn: Connection) -> object:
    return pickle.loads(conn.recv_bytes())


class PendingBitmask:
    """A step's grammar bitmask still on its way from the core (it follows the step on the
    pipe): read when sampling first needs it, so the forward pass does not wait for it."""

    def __init__(self, conn: Connection, step_id: int) -> None:
        self._conn = conn
        self._step_id = step_id
        self._message: StepBitmask | None = None

    def _read(self) -> StepBitmask:
        if self._message is None:
            message = recv_message(self._conn)
            if not isinstance(message, StepBitmask) or message.step_id != self._step_id:
                raise RuntimeError(f"expected the grammar bitmask of microbatch "
                                   f"{self._step_id}, got {message!r:.200}")
            self._message = message
        return self._message

    @property
    def req_ids(self) -> list[str]:
        return self._read().req_ids

    def result(self) -> torch.Tensor:
        message = self._read()
        if message.bitmask is None:
            raise RuntimeError(f"the grammar bitmask was not filled: {message.error}")
        return message.bitmask

    def consume(self) -> None:
        """Reads the message if sampling did not (the step failed before it)."""
        self._read()


class StageWorker:
    """The message loop of one stage."""

    def __init__(self, runner: StageRunner, conn: Connection,
                 transfer_conn: Connection | None = None) -> None:
        self.runner = runner
        self.conn = conn
        # The pipe of the KV transfer commands (kvtransfer/ranked.py), when the engine runs
        # a connector.
        self.transfer_conn = transfer_conn
        self.stage = runner.pipeline_stage
        # A stage's tensor-parallel rank 0 speaks for it: the last stage's answers steps
        # (and is sent their grammar bitmasks); each stage's reports its timing.
        self.speaks = runner.tp.rank == 0
        self.answers = self.stage.is_last and self.speaks

    def _start_transfer_agent(self, spec: RankAgentSpec | None) -> RankAgentInfo | None:
        """This rank's NIXL agent, its cache registered (once per block group it serves),
        serving the core's transfer commands from a thread of its own."""
        if spec is None:
            return None
        if self.transfer_conn is None:
            raise ValueError("KV transfer needs the worker's transfer pipe")
        from kvferry.kvtransfer.ranked import RankAgentServer

        runner = self.runner
        rank = self.stage.index * runner.tp.size + runner.tp.rank
        server = RankAgentServer(self.transfer_conn, spec, rank,
                                 [runner.kv_cache] * spec.num_groups,
                                 self.stage.start_layer, runner.first_kv_head)
        server.start()
        return server.info

    def run(self) -> None:
        while True:
            message = recv_message(self.conn)
            if isinstance(message, StepRequest):
                self._step(message)
            elif isinstance(message, InitializeKVCache):
                # A cache the transfer agent registers goes where reads are fast.
                self.runner.initialize_kv_cache(message.num_blocks,
                                                for_transfer=message.transfer is not None)
                send_message(self.conn, KVCacheReady(
                    self.stage.index, self._start_transfer_agent(message.transfer)))
            elif isinstance(message, RecoverFromFailedStep):
                self.runner.recover_from_failed_step(message.failed_req_ids)
            elif isinstance(message, ReleasePromptEmbeds):
                self.runner.release_prompt_embeds(set(message.req_ids))
            elif isinstance(message, ShutdownStage):
                return
            else:
                raise TypeError(f"pipeline stage {self.stage.index} got an unknown message "
                                f"{type(message).__name__}")

    def _step(self, request: StepRequest) -> None:
        started = time.monotonic()
        bitmask = None
        if request.has_grammar_bitmask and self.answers:
            bitmask = PendingBitmask(self.conn, request.step_id)
        answer: StepDone | StepFailed
        try:
            output = self.runner.execute_stage(request, bitmask)  # type: ignore[arg-type]
            answer = StepDone(request.step_id, output)
        except StageStepFailed as exc:
            answer = StepFailed(request.step_id, exc.origin, exc.message)
        finally:
            if bitmask is not None:
                bitmask.consume()
        if self.speaks:
            send_message(self.conn, StageTiming(request.step_id, self.stage.index, started,
                                                time.monotonic(), self.runner.recv_wait_s))
        if self.answers:
            send_message(self.conn, answer)


def run_worker(conn: Connection, parent_pid: int,
               transfer_conn: Connection | None = None) -> None:
    """The worker process's entry (multiprocessing spawn): reads `StageStart`, then runs
    until `ShutdownStage`; exits with status 0, or 1 after reporting `StageFatal`."""
    start = recv_message(conn)
    assert isinstance(start, StageStart), f"the first message must be StageStart: {start!r}"
    # Ctrl-C reaches the whole process group; the engine core decides how workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=start.log_level, format=(
        f"%(asctime)s %(levelname)s [pp-stage-{start.stage.index}] %(name)s: %(message)s"))
    _watch_parent(parent_pid)
    torch.set_num_threads(start.num_threads)
    torch.manual_seed(start.seed)
    exit_code = _serve(start, conn, transfer_conn)
    # The interpreter's own teardown (module and tensor finalizers) only delays giving the
    # memory back, by seconds on a busy host.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _serve(start: StageStart, conn: Connection, transfer_conn: Connection | None) -> int:

    index = start.stage.index
    try:
        try:
            runner = _start_stage(start, conn)
        except (ValueError, OSError) as exc:
            logger.error("pipeline stage %d cannot start: %s", index, exc)
            _report_fatal(conn, StageFatal(index, f"{type(exc).__name__}: {exc}",
                                           is_refusal=True))
            return 1
        StageWorker(runner, conn, transfer_conn).run()
        runner.link.wait_for_sends()
    except (EOFError, BrokenPipeError):
        logger.info("the engine core closed the pipe; stage %d exits", index)
    except BaseException as exc:  # the worker's last word, whatever it is
        logger.exception("pipeline stage %d failed", index)
        _report_fatal(conn, StageFatal(index, _describe(exc)))
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _start_stage(start: StageStart, conn: Connection) -> StageRunner:
    """Joins the process group, loads the stage (and on a GPU profiles it), reports ready."""
    from kvferry.engine.executor.p2p import StageLink
    from kvferry.engine.models.config import ModelArchConfig
    from kvferry.engine.models.loader import resolve_dtype
    from kvferry.engine.runner.model_runner import kv_cache_block_bytes

    stage = start.stage
    device = torch.device(start.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    loopback = _loopback_interface()
    if start.dist_backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and loopback:
        # The stages are processes of one machine: gloo over loopback, not over whatever
        # address the host name resolves to.
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
    tp_size = start.tp_size
    dist.init_process_group(start.dist_backend, init_method=start.dist_init_method,
                            rank=stage.index * tp_size + start.tp_rank,
                            world_size=stage.num_stages * tp_size)
    tp = TensorParallel(start.tp_rank, tp_size, _tensor_parallel_group(stage, tp_size))
    arch = ModelArchConfig.from_pretrained(start.model_dir)
    dtype = resolve_dtype(start.dtype, arch, device)
    link = StageLink(stage, arch.hidden_size, dtype, device, tp)
    runner = StageRunner(
        start.model_dir, arch, dtype, device, start.cache, stage, link,
        max_num_reqs=start.max_num_reqs, max_model_len=start.max_model_len,
        max_num_batched_tokens=start.max_num_batched_tokens,
        attention_backend=start.attention_backend, tp=tp,
    )
    budget = None
    if start.cache.num_gpu_blocks_override is None:
        budget = runner.measure_kv_cache_budget(start.gpu_memory_utilization,
                                                start.max_num_reqs)
    block_bytes = kv_cache_block_bytes(arch, start.cache.block_size, dtype, stage.num_layers,
                                       runner.num_kv_heads)
    send_message(conn, StageReady(stage.index, block_bytes, budget))
    return runner


def _tensor_parallel_group(stage: PipelineStage, tp_size: int) -> dist.ProcessGroup | None:
    """The process group of this stage's tensor-parallel ranks (None without tensor
    parallelism). Every process creates every stage's group, in stage order, as
    torch.distributed requires, and keeps its own."""
    if tp_size == 1:
        return None
    ours = None
    for index in range(stage.num_stages):
        group = dist.new_group(list(range(index * tp_size, (index + 1) * tp_size)))
        if index == stage.index:
            ours = group
    return ours


def _loopback_interface() -> str | None:
    import socket

    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name.startswith("lo")), None)


def _describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _report_fatal(conn: Connection, message: StageFatal) -> None:
    try:
        send_message(conn, message)
    except OSError:
        pass  # the core is gone too


def _watch_parent(parent_pid: int) -> None:
    """Exits the process when the engine core is gone (an orphan is re-parented)."""

    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_INTERVAL_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
