"""The engine core in its own process, behind two ZMQ sockets.

Why two processes: the server's front end (HTTP, tokenization, detokenization, stop
strings) is Python work that would otherwise take turns with the model step under one GIL.
With the core (scheduler, KV cache, model runner) in a process of its own, a step runs while
the front end parses the next requests and streams the last step's tokens, and the loop never
waits on a slow client.

What crosses (engine/core/messages.py, msgspec msgpack, one tagged struct per message kind):

- front end -> core, on a PUSH/PULL pair: `AddRequest` (one tokenized, validated sequence),
  `AbortRequests` (ids; the client went away or a stop string ended them) and `ShutdownCore`;
- core -> front end, on a second PUSH/PULL pair: `CoreReady` once the model is loaded (the
  `EngineCoreInfo` the front end validates against), then `CoreStepOutputs` once per step
  (only the step's new tokens, and a `SchedulerStats` snapshot), or `CoreFailed` with the
  exception text as its last word when loading or the loop fails.

The sockets are `ipc://` paths in a private temporary directory; the front end binds both, so
they outlive a core that dies, and the core connects.

Death: the core blocks on its input socket when idle (no busy spin) and wakes at least every
`PARENT_CHECK_INTERVAL_S` to check that the process that started it is still its parent; when
the front end is gone (killed, out of memory) it exits, so no orphan keeps the model's memory.
The front end watches the core's process sentinel (engine/frontend/async_llm.py).

The loop is drain inputs -> step -> send. A pipeline-parallel executor (several steps in
flight) or a KV connector (transfers finishing between steps) plugs in at
`EngineCoreProc._run_busy` without changing the messages the front end sees. When a
pipeline stage's worker dies, the steps in flight fail their requests, and the loop ends
with `CoreFailed`: the server exits non-zero and the pod restarts.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq
from kvferry.engine.config import EngineConfig
from kvferry.engine.core.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreInput,
    CoreOutput,
    CoreReady,
    CoreStepOutputs,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
    ShutdownCore,
)
from kvferry.engine.core.request import RequestStatus

if TYPE_CHECKING:
    from kvferry.engine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)

# How often an idle core wakes to check that the front end still exists (and how often a
# busy one checks between steps).
PARENT_CHECK_INTERVAL_S = 1.0
# Milliseconds between steps while only KV transfers are in progress: the transfer thread
# polls NIXL every millisecond on its own, so this only bounds how late the scheduler
# learns of a finished pull or a freed hold.
TRANSFER_POLL_MS = 2
# How long the core's last messages may wait to be delivered when it exits.
_OUTPUT_LINGER_MS = 2000

_ABORT_STATUS = {
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH_CAPPED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


@dataclass(frozen=True)
class CoreAddresses:
    """The two sockets between front end and core (both bound by the front end)."""

    # Front end -> core (requests, aborts, shutdown).
    input: str
    # Core -> front end (ready, step outputs, failure).
    output: str


class FrontEndGone(Exception):
    """The front end that started the core no longer exists."""


class EngineCoreFatal(Exception):
    """The engine core can run no further step (its message says why)."""


class EngineCoreProc:
    """The core's loop: drain inputs, step while there is work, send each step's outputs."""

    def __init__(
        self,
        engine_core: EngineCore,
        input_socket: zmq.Socket,
        output_socket: zmq.Socket,
        parent_pid: int,
    ) -> None:
        self.engine_core = engine_core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid
        self.decoder = msgspec.msgpack.Decoder(CoreInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.num_requests_received = 0
        # Outputs made outside a step (a request the core refused), sent with the next one.
        self.pending_outputs: list[EngineCoreOutput] = []
        self.is_shutdown_requested = False
        # The stats last sent, so idle transfer steps send only what changed.
        self._last_stats: SchedulerStats | None = None
        self._next_parent_check = time.monotonic() + PARENT_CHECK_INTERVAL_S

    def run(self) -> None:
        """Runs until the front end asks to stop or goes away."""
        while not self.is_shutdown_requested:
            if not self.engine_core.has_unfinished_requests() and not self._wait_for_input():
                continue
            num_handled = self._drain_inputs()
            if self.is_shutdown_requested:
                return
            if self.engine_core.has_unfinished_requests():
                self._run_busy()
            elif num_handled:
                # Inputs that left nothing to run (aborts, refused requests): the front end
                # still learns the new state, e.g. that an aborted request's blocks are free.
                self._send_outputs(EngineCoreOutputs([], self.engine_core.scheduler.make_stats()))
            self._check_engine()
            self._check_parent()

    # ------------------------------------------------------------------ phases
    def _wait_for_input(self) -> bool:
        """Sleeps on the input socket until a message (True) or the next parent check."""
        timeout_ms = int(PARENT_CHECK_INTERVAL_S * 1000)
        if self.input_socket.poll(timeout_ms, zmq.POLLIN):
            return True
        self._check_engine()
        self._check_parent(force=True)
        return False

    def _run_busy(self) -> None:
        """One step of the requests in the core (it also collects finished KV transfers).

        While the only work is transfers (pulls in flight, blocks held under a lease), the
        loop waits for input between steps instead of spinning a core, and sends a step's
        outputs only when they changed what the front end knows.
        """
        core = self.engine_core
        if core.has_requests_to_compute():
            self._send_outputs(core.step())
            return
        self.input_socket.poll(TRANSFER_POLL_MS, zmq.POLLIN)
        outputs = core.step()
        if outputs.outputs or outputs.scheduler_stats != self._last_stats:
            self._send_outputs(outputs)

    def _drain_inputs(self) -> int:
        """Handles every message already waiting, without blocking; returns how many."""
        num_handled = 0
        while True:
            try:
                frame = self.input_socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return num_handled
            self._handle(self.decoder.decode(frame.buffer))
            num_handled += 1

    def _handle(self, message: CoreInput) -> None:
        if isinstance(message, AddRequest):
            self.num_requests_received += 1
            self._add_request(message)
        elif isinstance(message, AbortRequests):
            status = _ABORT_STATUS[message.finish_reason]
            self.engine_core.abort_requests(message.req_ids, status)
        elif isinstance(message, ShutdownCore):
            self.is_shutdown_requested = True

    def _add_request(self, message: AddRequest) -> None:
        request = message.request
        try:
            self.engine_core.add_request(request)
        except ValueError as exc:
            # The front end validated it against the same limits, so this is a race (an id
            # reused before its abort arrived) or a bug; only this request fails.
            logger.warning("request %r refused by the engine core: %s", request.req_id, exc)
            self.pending_outputs.append(
                EngineCoreOutput(request.req_id, [], finish_reason=FinishReason.ERROR)
            )

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        if self.pending_outputs:
            outputs.outputs = self.pending_outputs + outputs.outputs
            self.pending_outputs = []
        self._last_stats = outputs.scheduler_stats
        message = CoreStepOutputs(outputs, self.num_requests_received)
        self.output_socket.send(self.encoder.encode(message), copy=False)

    def _check_engine(self) -> None:
        """Ends the loop when no further step can run (a pipeline stage died): the steps
        that failed have told the front end; the process then exits with `CoreFailed`,
        and the server with it, so that the pod restarts."""
        error = self.engine_core.fatal_error
        if error is not None:
            raise EngineCoreFatal(str(error))

    def _check_parent(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_parent_check:
            return
        self._next_parent_check = now + PARENT_CHECK_INTERVAL_S
        # An orphan is re-parented (to init or a subreaper), so its parent pid changes.
        if os.getppid() != self.parent_pid:
            raise FrontEndGone(f"the front end (pid {self.parent_pid}) is gone")


# ---------------------------------------------------------------------- process entry
class ModelLoadError(Exception):
    """The engine core refused its model: a checkpoint it cannot read or load, or settings
    that do not fit it (ValueError and OSError while loading; its message is theirs)."""


def run_engine_core(
    config: EngineConfig, addresses: CoreAddresses, parent_pid: int, log_level: int
) -> None:
    """The core process's main function: load, report ready (or the failure), loop, exit.

    Exits with status 0 after a `ShutdownCore` or when the front end is gone, and 1 when
    loading or the loop failed (after sending `CoreFailed`).
    """
    _setup_process(log_level)
    context = zmq.Context()
    input_socket = open_socket(context, zmq.PULL, addresses.input, bind=False)
    output_socket = open_socket(context, zmq.PUSH, addresses.output, bind=False)
    output_socket.setsockopt(zmq.LINGER, _OUTPUT_LINGER_MS)
    encoder = msgspec.msgpack.Encoder()
    exit_code = 0
    orphaned = False
    try:
        _serve(config, input_socket, output_socket, parent_pid, encoder)
    except FrontEndGone as exc:
        logger.warning("engine core exiting: %s", exc)
        output_socket.setsockopt(zmq.LINGER, 0)  # nobody will read what is left
        orphaned = True
    except ModelLoadError as exc:  # the checkpoint or a setting: what, not where, is news
        logger.error("engine core failed to load the model: %s", exc)
        _send(output_socket, encoder, CoreFailed(str(exc)))
        exit_code = 1
    except EngineCoreFatal as exc:
        logger.error("engine core cannot go on: %s", exc)
        _send(output_socket, encoder, CoreFailed(str(exc)))
        exit_code = 1
    except Exception as exc:  # noqa: BLE001 - process boundary: report any failure, then exit
        logger.exception("engine core failed")
        _send(output_socket, encoder, CoreFailed(f"{type(exc).__name__}: {exc}"))
        exit_code = 1
    finally:
        input_socket.close(linger=0)
        output_socket.close()
        context.term()
    if orphaned:
        # The engine is shut down; the interpreter's own teardown (module and tensor
        # finalizers) only delays giving the memory back, by seconds on a busy host.
        logging.shutdown()
        os._exit(0)
    if exit_code:
        raise SystemExit(exit_code)


def _serve(
    config: EngineConfig,
    input_socket: zmq.Socket,
    output_socket: zmq.Socket,
    parent_pid: int,
    encoder: msgspec.msgpack.Encoder,
) -> None:
    # Imported here: torch and the model code load in the core process only.
    from kvferry.engine.core.engine_core import EngineCore

    try:
        engine_core = EngineCore(config)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{type(exc).__name__}: {exc}") from exc
    try:
        _send(output_socket, encoder, CoreReady(engine_core.info))
        EngineCoreProc(engine_core, input_socket, output_socket, parent_pid).run()
    finally:
        engine_core.shutdown()
    logger.info("engine core shut down")


def _send(socket: zmq.Socket, encoder: msgspec.msgpack.Encoder, message: CoreOutput) -> None:
    socket.send(encoder.encode(message), copy=False)


def open_socket(context: zmq.Context, kind: int, address: str, *, bind: bool) -> zmq.Socket:
    """A socket of either end of the front end <-> core pair."""
    socket = context.socket(kind)
    # No high-water mark: a burst of requests or outputs queues instead of blocking a send.
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    if bind:
        socket.bind(address)
    else:
        socket.connect(address)
    return socket


def main(argv: list[str] | None = None) -> None:
    """`python -m kvferry.engine.frontend.core_process`: how the front end starts the core.

    A fresh interpreter (not a fork) inherits no event loop, threads or accelerator context
    from the server, and does not re-import the server's main module.
    """
    parser = argparse.ArgumentParser(description="kvferry engine core (started by the server)")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--input", required=True, help="ZMQ address of the request socket")
    parser.add_argument("--output", required=True, help="ZMQ address of the output socket")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", type=int, default=logging.INFO)
    args = parser.parse_args(argv)
    config = msgspec.json.decode(args.config, type=EngineConfig)
    if config.kv_transfer is not None:
        # The front end passes the key in the environment, never on the command line.
        config.kv_transfer = config.kv_transfer.with_key_from(os.environ)
    run_engine_core(config, CoreAddresses(args.input, args.output), args.parent_pid, args.log_level)


def _setup_process(log_level: int) -> None:
    # Ctrl-C reaches the whole process group; the front end decides how the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s [engine-core] %(name)s: %(message)s"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
