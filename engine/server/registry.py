"""An engine pod's side of the pod registry: it keeps its `PodRecord` and its KV events in
Redis while it serves (the key layout and record are `kvferry.protocol.registry`'s).

The record is refreshed from a thread of its own, not from the server's event loop: a loop
busy with a burst of requests (parsing, tokenizing, detokenizing a thousand of them) can go
seconds without running a task, and a pod that serves must not look gone for it. The loop
only hands the thread its latest stats and KV events, and beats a heartbeat; a loop that
misses it for LOOP_STALL_LIMIT_S is wedged, not busy, and the record is let expire.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

from kvferry.engine.core.messages import SchedulerStats
from kvferry.kvtransfer.auth import TransferKey
from redis.exceptions import RedisError

from kvferry.protocol.kv_events import EVENT_STREAM_MAXLEN, KVEventBatch, kv_events_key
from kvferry.protocol.record_auth import sign_batch, sign_record
from kvferry.protocol.registry import REGISTRY_TTL_S, PodRecord, pod_key_prefix

logger = logging.getLogger("kvferry.engine.server.registry")

# Several refreshes per TTL, so that one slow refresh (Redis slow to answer) does not drop it.
REFRESH_INTERVAL_S = 0.5
# KV events go out this often (batched), so the router's prefix index lags by about this.
EVENT_FLUSH_S = 0.1
# How often the event loop beats; the thread publishes while a beat is newer than the limit.
LOOP_BEAT_S = 1.0
# A loop that has not run a callback for this long serves nothing (a request blocked on it
# this long has failed anyway): the record is let expire, and the router stops choosing it.
LOOP_STALL_LIMIT_S = 30.0
# Longest wait for Redis on one call, so that a Redis gone silent cannot hang the thread
# (nor `stop`, which waits for it).
REDIS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class RegistrationSettings:
    """How `kvferry serve --redis URL` registers its pod."""

    redis_url: str
    service: str
    role: str
    pod: str
    url: str  # the address other pods and the router reach this server at
    # The service's KV transfer key: the record and KV events go out signed with it, so a
    # router with the key can tell them from whatever else is written to Redis.
    key: TransferKey | None = field(default=None, repr=False)


def registration_settings(redis_url: str, service: str | None, role: str, host: str,
                          port: int, pod_ip: str | None,
                          key: TransferKey | None = None) -> RegistrationSettings:
    """The pod's name is its hostname plus port (unique on one machine under `kvferry up`);
    the advertised address is POD_IP, else the listen host unless it is a wildcard."""
    advertise = pod_ip or (host if host not in ("0.0.0.0", "::", "") else "127.0.0.1")
    pod = os.environ.get("KVFERRY_POD_NAME") or f"{socket.gethostname()}-{port}"
    return RegistrationSettings(redis_url=redis_url, service=service or "default", role=role,
                                pod=pod, url=f"http://{advertise}:{port}", key=key)


@dataclass(frozen=True)
class PendingEvents:
    """One step's KV events, waiting for the thread to publish them."""

    evicted: list[bytes] = field(default_factory=list)  # decoder block hashes
    stored: list[bytes] = field(default_factory=list)
    cross_evicted: list[bytes] = field(default_factory=list)  # cross-attention block hashes
    cross_stored: list[bytes] = field(default_factory=list)

    @property
    def has_any(self) -> bool:
        return bool(self.evicted or self.stored or self.cross_evicted or self.cross_stored)


class PodRegistrar:
    """Keeps this pod's registry key alive while the server serves.

    `start` and `stop` run on the server's event loop, and so does `record_stats` (an engine
    stats listener); everything that talks to Redis runs on the registrar's thread, except the
    goodbye in `stop`, which runs once the thread has ended.
    """

    def __init__(self, settings: RegistrationSettings, model: str, block_size: int,
                 max_model_len: int = 0, max_token_chars: int = 0, encoder_input: str = "",
                 max_encoder_len: int = 0) -> None:
        import redis

        self.settings = settings
        self.model = model
        self.block_size = block_size
        # Announced so that the router refuses a text that cannot fit before tokenizing it.
        self.max_model_len = max_model_len
        self.max_token_chars = max_token_chars
        # Encoder-decoder models (the engine's limits): the router keys encoder inputs and
        # runs the encode hop by them.
        self.encoder_input = encoder_input
        self.max_encoder_len = max_encoder_len
        # The latest load, replaced whole by the loop and read by the thread.
        self.stats = SchedulerStats()
        # This engine process, in its KV events: a reader that sees the pod's instance
        # change drops what the previous process held.
        self.instance_id = uuid.uuid4().hex
        # Event batches not yet published, oldest first; the first, empty, announces this
        # instance with a cache that holds nothing yet. The loop appends, the thread takes
        # them all; the lock makes the take and the appends exclusive.
        self._pending_events: list[PendingEvents] = [PendingEvents()]
        self._events_lock = threading.Lock()
        self._redis = redis.Redis.from_url(settings.redis_url, socket_timeout=REDIS_TIMEOUT_S,
                                           socket_connect_timeout=REDIS_TIMEOUT_S)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # time.monotonic() of the event loop's last heartbeat.
        self._loop_beat_at = time.monotonic()
        self._beat_handle: asyncio.TimerHandle | None = None
        # What the thread last logged: a warning per change of state, not per attempt.
        self._is_redis_failing = False
        self._is_loop_stalled = False
        self.key = pod_key_prefix(settings.service) + settings.pod

    # ------------------------------------------------------------------ the loop's side
    def record_stats(self, scheduler: SchedulerStats, _iteration: object) -> None:
        """An AsyncLLM stats listener: keeps the latest load and the step's KV events."""
        self.stats = scheduler
        events = PendingEvents(scheduler.evicted_block_hashes, scheduler.stored_block_hashes,
                               scheduler.evicted_cross_hashes, scheduler.stored_cross_hashes)
        if events.has_any:
            with self._events_lock:
                self._pending_events.append(events)

    def start(self) -> None:
        """Publishes the record once, then starts the heartbeat on the running loop and the
        refresh thread. The first record is written here, before the pod says it is ready:
        left to the thread, a loaded machine could let the router (or a probe) see a ready
        pod with no record yet."""
        self._beat(asyncio.get_running_loop())
        try:
            self.publish()
        except (OSError, RedisError) as exc:  # the thread keeps trying
            self._redis_failed(exc)
        self._thread = threading.Thread(target=self._refresh_forever, daemon=True,
                                        name=f"kvferry-registry-{self.settings.pod}")
        self._thread.start()
        logger.info("registered as %s (%s) in %s", self.key, self.settings.url,
                    _without_password(self.settings.redis_url))

    async def stop(self) -> None:
        """Stops refreshing and replaces the record by a leaving one, so the router stops
        choosing this pod now (its key then expires)."""
        if self._beat_handle is not None:
            self._beat_handle.cancel()
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            # Within one Redis timeout: the thread's calls are bounded by it.
            await asyncio.to_thread(thread.join)
        try:
            await asyncio.to_thread(self.publish, True)
        except (OSError, RedisError) as exc:  # the TTL removes the key anyway
            logger.warning("pod registry: could not mark %s as leaving: %s", self.key, exc)
        finally:
            await asyncio.to_thread(self._redis.close)

    def _beat(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop_beat_at = time.monotonic()
        self._beat_handle = loop.call_later(LOOP_BEAT_S, self._beat, loop)

    # ------------------------------------------------------------------ what is published
    def record(self, is_leaving: bool = False) -> PodRecord:
        """The pod's record now, signed when the pod has the service's key."""
        s = self.settings
        stats = self.stats
        record = PodRecord(pod=s.pod, service=s.service, role=s.role, model=self.model,
                           url=s.url, block_size=self.block_size,
                           num_running=stats.num_running_reqs,
                           num_waiting=stats.num_waiting_reqs,
                           kv_cache_usage=stats.kv_cache_usage, updated_at=time.time(),
                           max_model_len=self.max_model_len,
                           max_token_chars=self.max_token_chars, is_leaving=is_leaving,
                           encoder_input=self.encoder_input,
                           max_encoder_len=self.max_encoder_len)
        return record if s.key is None else sign_record(record, s.key)

    def event_batch(self, evicted: list[bytes], stored: list[bytes],
                    cross_evicted: list[bytes] | None = None,
                    cross_stored: list[bytes] | None = None) -> KVEventBatch:
        """One step's KV events as published, signed when the pod has the key."""
        batch = KVEventBatch(self.settings.pod, self.instance_id.encode(), evicted, stored,
                             cross_evicted=cross_evicted or [],
                             cross_stored=cross_stored or [])
        return batch if self.settings.key is None else sign_batch(batch, self.settings.key)

    def publish(self, is_leaving: bool = False) -> None:
        """Writes the record with a fresh TTL (blocking: the thread's, or `stop`'s)."""
        ttl_ms = int(REGISTRY_TTL_S * 1000)
        self._redis.set(self.key, self.record(is_leaving).to_json(), px=ttl_ms)

    def publish_events(self) -> None:
        """Writes the KV event batches the loop handed over (blocking)."""
        with self._events_lock:
            batches, self._pending_events = self._pending_events, []
        if not batches:
            return
        key = kv_events_key(self.settings.service)
        with self._redis.pipeline(transaction=False) as pipe:
            for events in batches:
                batch = self.event_batch(events.evicted, events.stored, events.cross_evicted,
                                         events.cross_stored)
                pipe.xadd(key, batch.to_fields(),  # type: ignore[arg-type]
                          maxlen=EVENT_STREAM_MAXLEN, approximate=True)
            pipe.execute()

    # ------------------------------------------------------------------ the thread
    def _refresh_forever(self) -> None:
        next_refresh = 0.0
        while not self._stopping.is_set():
            now = time.monotonic()
            try:
                if now >= next_refresh:
                    next_refresh = now + REFRESH_INTERVAL_S
                    if self._is_loop_alive(now):
                        self.publish()
                self.publish_events()
            except (OSError, RedisError) as exc:
                # Redis being away must not stop serving; the key comes back when it does.
                self._redis_failed(exc)
            else:
                self._redis_answered()
            self._stopping.wait(EVENT_FLUSH_S)

    def _is_loop_alive(self, now: float) -> bool:
        is_stalled = now - self._loop_beat_at > LOOP_STALL_LIMIT_S
        if is_stalled != self._is_loop_stalled:
            self._is_loop_stalled = is_stalled
            if is_stalled:
                logger.error("pod registry: the event loop has not run for %.0f s: no longer "
                             "refreshing %s, so the router stops choosing this pod", 
                             now - self._loop_beat_at, self.key)
            else:
                logger.warning("pod registry: the event loop runs again: refreshing %s",
                               self.key)
        return not is_stalled

    def _redis_failed(self, exc: Exception) -> None:
        if not self._is_redis_failing:
            self._is_redis_failing = True
            logger.warning("pod registry: cannot reach Redis: %s", exc)

    def _redis_answered(self) -> None:
        if self._is_redis_failing:
            self._is_redis_failing = False
            logger.info("pod registry: Redis answers again; %s refreshed", self.key)


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.split('@', 1)[1]}"
