"""The server's settings and its shared state (the engine, metrics, phase, in-flight count)."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvferry.http_limits import HttpLimits
from kvferry.protocol.request_fields import UnknownFields

# The largest request body read by default (the router's default too).
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# The largest /v1/completions body carrying prompt_embeds, by default (the router's too):
# base64 of a torch.save payload is 4/3 of the tensor's bytes, so this holds prompts of
# about 24 MiB of embeddings (6,000 float32 rows of 1,024 values).
DEFAULT_MAX_EMBEDS_BODY_BYTES = 32 * 1024 * 1024
# The largest /v1/audio/transcriptions body by default: OpenAI's limit on an upload (25 MiB),
# which holds about 13 minutes of 16 kHz 16-bit WAV.
DEFAULT_MAX_AUDIO_BODY_BYTES = 25 * 1024 * 1024
# The most `stop` strings a request may give, and their most UTF-8 bytes in all. Every new
# token is matched against each of them, so they bound the work one request adds to every
# step; clients use a handful (OpenAI takes 4).
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_BYTES = 16 * 1024
# `--tool-call-parser` choices: the model output formats tool_choice "auto" can read
# (engine/server/tool_calls.py).
TOOL_CALL_PARSERS = ("hermes",)

if TYPE_CHECKING:
    from kvferry.engine.frontend.async_llm import AsyncLLM
    from kvferry.engine.server.metrics import EngineMetrics
    from kvferry.engine.server.registry import RegistrationSettings
    from kvferry.engine.server.transcriptions import Transcriber


@dataclass(frozen=True)
class ServerSettings:
    """What `kvferry serve` configures beyond the engine."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Clients must send `Authorization: Bearer <api_key>` when set.
    api_key: str | None = None
    # `--chat-template`: a file or the template text; None uses the tokenizer's.
    chat_template: str | None = None
    # `--tool-call-parser`: the model's tool-call format, which tool_choice "auto" needs.
    tool_call_parser: str | None = None
    # 429 while this many requests wait in the engine; None for no limit.
    max_num_waiting: int | None = None
    # 413 for a request body larger than this, before reading it.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # The larger limit of a /v1/completions body carrying prompt_embeds; None: the engine
    # takes no prompt embeddings, so no body gets past max_body_bytes.
    max_embeds_body_bytes: int | None = None
    # 413 for a /v1/audio/transcriptions body (the form with its file) larger than this.
    max_audio_body_bytes: int = DEFAULT_MAX_AUDIO_BODY_BYTES
    # 400 for a request with more `stop` strings than this, or more UTF-8 bytes in them.
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_bytes: int = DEFAULT_MAX_STOP_BYTES
    # On SIGTERM, seconds to let in-flight requests finish before exiting anyway.
    drain_timeout_s: float = 30.0
    # Put prompt text in the per-request log lines.
    log_prompts: bool = False
    uvicorn_log_level: str = "warning"
    # `--redis`: announce this pod in the service's pod registry; None: do not.
    registration: RegistrationSettings | None = None
    # Header, body and idle timeouts, and the most open client connections.
    http_limits: HttpLimits = field(default_factory=HttpLimits)


class Phase(enum.Enum):
    LOADING = "loading"  # the engine core is loading the model
    READY = "ready"  # serving
    DRAINING = "draining"  # SIGTERM: finishing in-flight requests, refusing new ones
    DEAD = "dead"  # the engine core died or failed to load


@dataclass
class ServerState:
    """Shared by the routes, the middleware and the lifecycle."""

    settings: ServerSettings
    served_model_name: str
    phase: Phase = Phase.LOADING
    engine: AsyncLLM | None = None
    metrics: EngineMetrics | None = None
    # The audio front end of a Whisper model (None: the model does not take audio).
    transcriber: Transcriber | None = None
    # The chat template in use (None: the model has none).
    chat_template: str | None = None
    # Why the engine is unavailable (load failure or death), for 503 messages.
    failure: str | None = None
    # Generation requests being served (HTTP level, streams included).
    num_in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    # Request fields no schema has: each name logged once, all counted in the metrics.
    unknown_fields: UnknownFields = field(default_factory=lambda: UnknownFields("kvferry serve"))

    def __post_init__(self) -> None:
        self.idle.set()

    def request_started(self) -> None:
        self.num_in_flight += 1
        self.idle.clear()

    def note_unknown_fields(self, endpoint: str, names: list[str]) -> None:
        if names:
            self.unknown_fields.record(endpoint, names)
            if self.metrics is not None:
                self.metrics.unknown_request_fields.inc(len(names))

    def request_finished(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self.idle.set()

    def unavailable_reason(self) -> str | None:
        """Why requests are refused now (503), or None when serving."""
        if self.phase is Phase.READY and self.engine is not None and self.engine.is_ready:
            return None
        if self.phase is Phase.LOADING:
            return "the model is loading; retry shortly"
        if self.phase is Phase.DRAINING:
            return "the server is shutting down and takes no new requests"
        return f"the engine is not available: {self.failure or 'it stopped'}"
