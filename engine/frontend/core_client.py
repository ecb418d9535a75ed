"""The front end's end of the engine-core process: start it, talk to it, see it die, stop it.

The core runs `python -m kvferry.engine.frontend.core_process`: a fresh interpreter, so it inherits
no event loop, threads or accelerator context from the server and never re-imports the
server's main module (multiprocessing's "spawn" would). Its config goes on the command
line as JSON (msgspec encodes the config dataclasses). The front end binds both `ipc://`
sockets in a private temporary directory before the core starts, so nothing the core sends
is lost to a slow connect, and the sockets stay valid if the core dies.

Death is seen by a task awaiting the process's exit (asyncio's child watcher): a core that
is killed, runs out of memory or crashes is noticed at once, without polling, and every
request is failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace

import msgspec
import zmq
import zmq.asyncio
from kvferry.engine.config import EngineConfig
from kvferry.engine.core.messages import (
    CoreFailed,
    CoreInput,
    CoreOutput,
    CoreReady,
    EngineCoreInfo,
    ShutdownCore,
)
from kvferry.engine.frontend.core_process import open_socket

logger = logging.getLogger(__name__)

# After the core's process ends while loading, how long its last message (the reason) may
# still take to arrive.
_LAST_WORD_TIMEOUT_S = 1.0
# After a terminate (SIGTERM), how long before SIGKILL.
_TERMINATE_TIMEOUT_S = 2.0


class EngineDeadError(RuntimeError):
    """The engine-core process died or cannot be reached; requests cannot be served."""


class CoreClient:
    """Owns the engine-core process and the two sockets to it."""

    def __init__(
        self,
        ipc_dir: str,
        context: zmq.Context,
        async_context: zmq.asyncio.Context,
        input_socket: zmq.Socket,
        output_socket: zmq.asyncio.Socket,
    ) -> None:
        self._ipc_dir = ipc_dir
        self._context = context
        self._async_context = async_context
        # Sends are synchronous: with no high-water mark a send to a connected core only
        # queues the message for ZMQ's I/O thread, so it never blocks the event loop.
        self._input_socket = input_socket
        self._output_socket = output_socket
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreOutput)
        self.process: asyncio.subprocess.Process | None = None
        # Completes when the process ends.
        self._exit_task: asyncio.Task[int] | None = None
        self._is_closed = False

    @classmethod
    async def start(cls, config: EngineConfig) -> CoreClient:
        """Binds the sockets and starts the core process (which then loads the model)."""
        ipc_dir = tempfile.mkdtemp(prefix="kvferry-core-")
        _check_ipc_path(ipc_dir)
        input_address, output_address = f"ipc://{ipc_dir}/input", f"ipc://{ipc_dir}/output"
        context, async_context = zmq.Context(), zmq.asyncio.Context()
        client = cls(
            ipc_dir, context, async_context,
            open_socket(context, zmq.PUSH, input_address, bind=True),
            open_socket(async_context, zmq.PULL, output_address, bind=True),
        )
        config_json, secret_env = _config_for_core(config)
        try:
            client.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvferry.engine.frontend.core_process",
                "--config", config_json,
                "--input", input_address, "--output", output_address,
                "--parent-pid", str(os.getpid()),
                "--log-level", str(logging.getLogger("kvferry").getEffectiveLevel()),
                # Its own session: a Ctrl-C or a signal to the server's process group does
                # not reach it; the front end decides when and how it stops.
                start_new_session=True,
                env={**os.environ, **secret_env},
            )
        except BaseException:
            client.close()
            raise
        client._exit_task = asyncio.create_task(client.process.wait(), name="core-exit")
        logger.info("engine core process started (pid %d)", client.process.pid)
        return client

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def is_alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    # ------------------------------------------------------------------ messages
    def send(self, message: CoreInput) -> None:
        """Queues a message for the core; EngineDeadError if the core is not connected.

        ZMQ blocks a PUSH send while no peer is connected (a core not started yet, or
        dead): NOBLOCK turns that into an error instead of a frozen event loop.
        """
        try:
            self._input_socket.send(self._encoder.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again as exc:
            raise EngineDeadError("the engine core process is not connected") from exc

    async def recv(self) -> CoreOutput:
        frame = await self._output_socket.recv(copy=False)
        return self._decoder.decode(frame.buffer)

    async def wait_until_ready(self) -> EngineCoreInfo:
        """Waits for the loaded core's info; EngineDeadError (with its reason) if it fails."""
        assert self._exit_task is not None, "start() first"
        message_task = asyncio.ensure_future(self.recv())
        try:
            await asyncio.wait(
                {message_task, self._exit_task}, return_when=asyncio.FIRST_COMPLETED
            )
            if not message_task.done():
                # It ended: the reason (CoreFailed) may still be on its way.
                await asyncio.wait({message_task}, timeout=_LAST_WORD_TIMEOUT_S)
        finally:
            # Cancelled here, the task is not done until the loop runs again: decide on
            # whether it had finished.
            unanswered = not message_task.done()
            if unanswered:
                message_task.cancel()
        if unanswered or message_task.cancelled():
            raise EngineDeadError(
                f"the engine core process {self.describe_exit()} while loading the model"
            )
        return _ready_info(message_task.result())

    # ------------------------------------------------------------------ death
    def watch_exit(self, on_exit: Callable[[], None]) -> None:
        """Calls `on_exit` once, from the event loop, when the core process ends."""
        assert self._exit_task is not None, "start() first"
        self._exit_task.add_done_callback(lambda _: on_exit())

    def describe_exit(self) -> str:
        """How the process ended, for error messages ("was killed by SIGKILL")."""
        code = None if self.process is None else self.process.returncode
        if code is None:
            return "is still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"was killed by {name}"
        return f"exited with code {code}"

    # ------------------------------------------------------------------ stop
    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Asks the core to exit, then terminates and kills it if it does not; closes all."""
        if self.is_alive() and not self._is_closed:
            with contextlib.suppress(EngineDeadError):  # not connected: it gets a signal
                self.send(ShutdownCore())
                await self._wait_exit(timeout_s)
        if self.is_alive():
            logger.warning("engine core did not exit within %.1f s; terminating it", timeout_s)
            self._signal(signal.SIGTERM)
            await self._wait_exit(_TERMINATE_TIMEOUT_S)
        if self.is_alive():
            self._signal(signal.SIGKILL)
            await self._wait_exit(_TERMINATE_TIMEOUT_S)
        self.close()

    def _signal(self, signum: signal.Signals) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)

    async def _wait_exit(self, timeout_s: float) -> None:
        if self._exit_task is not None:
            await asyncio.wait({self._exit_task}, timeout=timeout_s)

    def close(self) -> None:
        """Closes the sockets and removes their directory (the process is left alone)."""
        if self._is_closed:
            return
        self._is_closed = True
        self._input_socket.close(linger=0)
        self._output_socket.close(linger=0)
        self._context.term()
        self._async_context.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


def _config_for_core(config: EngineConfig) -> tuple[str, dict[str, str]]:
    """(the config as JSON for the core's command line, environment it needs besides).

    Secrets (the KV transfer key) travel in the environment: a command line is readable by
    every user of the machine.
    """
    if config.kv_transfer is None:
        return msgspec.json.encode(config).decode(), {}
    transfer, env = config.kv_transfer.key_for_child()
    return msgspec.json.encode(replace(config, kv_transfer=transfer)).decode(), env


def _ready_info(message: CoreOutput) -> EngineCoreInfo:
    if isinstance(message, CoreReady):
        return message.info
    if isinstance(message, CoreFailed):
        raise EngineDeadError(f"the engine core failed to load the model: {message.message}")
    raise EngineDeadError(f"the engine core sent {type(message).__name__} before it was ready")


# A Unix socket path holds at most 107 bytes (sockaddr_un.sun_path, less its terminator).
MAX_IPC_PATH_BYTES = 107


def _check_ipc_path(ipc_dir: str) -> None:
    """ValueError naming the fix when the sockets' paths under `ipc_dir` cannot be bound."""
    longest = len(f"{ipc_dir}/output".encode())
    if longest > MAX_IPC_PATH_BYTES:
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise ValueError(
            f"the engine's IPC socket path under {ipc_dir!r} is {longest} bytes, more than the "
            f"{MAX_IPC_PATH_BYTES} a Unix socket allows: point TMPDIR at a shorter directory")
