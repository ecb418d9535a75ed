"""The life of a `kvferry serve` process: listen, load, serve, drain or die, exit.

- The HTTP server listens first, so `/ping` answers (and `/health` says 503) while the
  engine core loads the model, which may take minutes.
- SIGTERM (or SIGINT) drains: new requests get 503, requests in flight run to the end
  within `--drain-timeout`, then the server stops and the process exits 0. A second
  signal stops at once.
- When the engine core dies, AsyncLLM fails every request in flight; the server answers
  503 to new ones, stops shortly after, and the process exits 1 so that Kubernetes
  restarts the pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Coroutine
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from kvferry.engine.config import EngineConfig
from kvferry.engine.server.chat_template import compile_template, load_chat_template
from kvferry.engine.server.state import Phase, ServerSettings, ServerState
from starlette.types import ASGIApp

from kvferry.http_protocol import uvicorn_options

if TYPE_CHECKING:
    from kvferry.engine.frontend.async_llm import AsyncLLM
    from kvferry.engine.server.registry import PodRegistrar
    from kvferry.engine.server.transcriptions import Transcriber

logger = logging.getLogger("kvferry.engine.server")

# After the engine dies, how long error responses get to reach their clients.
DEATH_GRACE_S = 0.5
# uvicorn's wait for open connections once the drain is over (they are idle by then).
CONNECTION_CLOSE_TIMEOUT_S = 3.0
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _SignalAwareServer(uvicorn.Server):
    """uvicorn, with its first SIGTERM/SIGINT handed to the drain instead of stopping."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.is_stopping:
            self.should_exit = True
            self.force_exit = True
            return
        self.lifecycle.loop.call_soon_threadsafe(self.lifecycle.on_signal, signal.Signals(sig))


class Lifecycle:
    """Drives one server process; `exit_code` is what the process returns."""

    def __init__(self, state: ServerState, config: EngineConfig, loop: asyncio.AbstractEventLoop
                 ) -> None:
        self.state = state
        self.config = config
        self.loop = loop
        self.server: _SignalAwareServer | None = None
        self.exit_code = EXIT_OK
        self.is_stopping = False
        self._load_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.registrar: PodRegistrar | None = None

    # ---------------------------------------------------------------- loading
    async def load_engine(self) -> None:
        import zmq
        from kvferry.engine.frontend.async_llm import AsyncLLM, EngineDeadError
        from kvferry.engine.server.metrics import EngineMetrics

        state = self.state
        try:
            engine = await AsyncLLM.create(
                self.config, max_num_waiting=state.settings.max_num_waiting)
        except (EngineDeadError, ValueError, OSError, zmq.ZMQError) as exc:
            logger.error("the engine failed to load: %s", exc)
            self._fail(f"it failed to load: {exc}")
            return
        try:
            state.transcriber = await _load_transcriber(engine)
        except (ValueError, OSError, ImportError) as exc:
            logger.error("the model's audio front end failed to load: %s", exc)
            await engine.shutdown()
            self._fail(f"it failed to load: {exc}")
            return
        state.engine = engine
        state.served_model_name = engine.served_model_name
        state.chat_template = load_chat_template(state.settings.chat_template,
                                                 engine.tokenizer.chat_template)
        info = engine.info
        state.metrics = EngineMetrics(engine.served_model_name, info.block_size,
                                      info.num_blocks - 1, self.config.cache.enable_prefix_caching,
                                      info.kv_transfer_enabled, engine.input_processor.admission)
        engine.add_stats_listener(state.metrics.record)
        engine.add_dead_listener(lambda error: self._fail(str(error)))
        if state.phase is Phase.LOADING:
            state.phase = Phase.READY
            self._register(engine, info.block_size)
            logger.info("serving %s on http://%s:%d", engine.served_model_name,
                        state.settings.host, state.settings.port)

    def _register(self, engine: AsyncLLM, block_size: int) -> None:
        registration = self.state.settings.registration
        if registration is None:
            return
        from kvferry.engine.server.registry import PodRegistrar

        limits = engine.input_processor.limits
        self.registrar = PodRegistrar(
            registration, engine.served_model_name, block_size,
            max_model_len=limits.max_model_len,
            max_token_chars=engine.tokenizer.max_token_chars or 0,
            encoder_input=limits.encoder_input if limits.is_encoder_decoder else "",
            max_encoder_len=limits.max_encoder_len)
        engine.add_stats_listener(self.registrar.record_stats)
        self.registrar.start()

    async def _deregister(self) -> None:
        registrar, self.registrar = self.registrar, None
        if registrar is not None:
            await registrar.stop()

    # ---------------------------------------------------------------- drain and death
    def on_signal(self, sig: signal.Signals) -> None:
        logger.info("%s: draining (in flight: %d, timeout %.0f s)", sig.name,
                    self.state.num_in_flight, self.state.settings.drain_timeout_s)
        self.is_stopping = True
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        if self.state.phase in (Phase.LOADING, Phase.READY):
            self.state.phase = Phase.DRAINING
        self._spawn(self._drain())

    async def _drain(self) -> None:
        # Leave the registry first, so the router sends nothing new while in-flight finish.
        await self._deregister()
        timeout = self.state.settings.drain_timeout_s
        try:
            await asyncio.wait_for(self.state.idle.wait(), timeout)
        except TimeoutError:
            logger.warning("drain timeout: %d requests still in flight are cut off",
                           self.state.num_in_flight)
        self._stop_server()

    def _fail(self, reason: str) -> None:
        """The engine is gone: refuse requests, and stop the process with a failure code."""
        self.state.failure = reason
        self.state.phase = Phase.DEAD
        self.exit_code = EXIT_FAILED
        self.is_stopping = True
        self._spawn(self._deregister())
        self.loop.call_later(DEATH_GRACE_S, self._stop_server)

    def _stop_server(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---------------------------------------------------------------- the whole run
    async def run(self, app: ASGIApp) -> int:
        settings = self.state.settings
        config = uvicorn.Config(
            app, host=settings.host, port=settings.port, log_level=settings.uvicorn_log_level,
            access_log=False, lifespan="off",
            timeout_graceful_shutdown=int(CONNECTION_CLOSE_TIMEOUT_S),
            **uvicorn_options(settings.http_limits),
        )
        self.server = _SignalAwareServer(config, self)
        server_task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if server_task.done():
                logger.error("the HTTP server could not start on %s:%d", settings.host,
                             settings.port)
                return EXIT_FAILED
            await asyncio.sleep(0.05)
        self._load_task = asyncio.create_task(self.load_engine())
        with contextlib.suppress(asyncio.CancelledError):
            await server_task
        await self._shutdown_engine()
        return self.exit_code

    async def _shutdown_engine(self) -> None:
        await self._deregister()
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._load_task
        if self.state.engine is not None:
            await self.state.engine.shutdown()


async def _load_transcriber(engine: AsyncLLM) -> Transcriber | None:
    """The audio front end of a model whose encoder reads audio (Whisper), else None; read
    off the event loop (it imports transformers). ValueError names what the checkpoint lacks."""
    from kvferry.engine.server.serving import takes_audio
    from kvferry.engine.server.transcriptions import Transcriber

    if not takes_audio(engine.input_processor.limits):
        return None
    return await asyncio.to_thread(Transcriber.load, engine.info.model_dir, engine.tokenizer)


def run_server(config: EngineConfig, settings: ServerSettings) -> int:
    """Runs `kvferry serve` to the end; returns the process exit code."""
    try:
        template = load_chat_template(settings.chat_template, None)
        if template is not None:
            compile_template(template)
    except (OSError, ValueError) as exc:
        logger.error("%s", exc)
        return EXIT_USAGE
    name = config.model.served_model_name or config.model.model
    return asyncio.run(_main(config, settings, name))


async def _main(config: EngineConfig, settings: ServerSettings, name: str) -> int:
    from kvferry.engine.server.api_server import build_app

    state = ServerState(settings, served_model_name=name)
    lifecycle = Lifecycle(state, config, asyncio.get_running_loop())
    return await lifecycle.run(build_app(state))
