"""An engine pod's side of the pod registry: it keeps its `PodRecord` and its KV events in
Redis while it serves (the key layout and record are `kvferry.protocol.registry`'s)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
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

# Several refreshes per TTL, so that one slow refresh (a busy event loop) does not drop it.
REFRESH_INTERVAL_S = 0.5
# KV events go out this often (batched), so the router's prefix index lags by about this.
EVENT_FLUSH_S = 0.1


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


class PodRegistrar:
    """Keeps this pod's registry key alive while the server serves."""

    def __init__(self, settings: RegistrationSettings, model: str, block_size: int,
                 max_model_len: int = 0, max_token_chars: int = 0) -> None:
        import redis.asyncio as aioredis

        self.settings = settings
        self.model = model
        self.block_size = block_size
        # Announced so that the router refuses a text that cannot fit before tokenizing it.
        self.max_model_len = max_model_len
        self.max_token_chars = max_token_chars
        self.stats = SchedulerStats()
        # This engine process, in its KV events: a reader that sees the pod's instance
        # change drops what the previous process held.
        self.instance_id = uuid.uuid4().hex
        # (evicted, stored) hash batches not yet published, oldest first; the first, empty,
        # announces this instance with a cache that holds nothing yet.
        self._pending_events: list[tuple[list[bytes], list[bytes]]] = [([], [])]
        self._redis = aioredis.from_url(settings.redis_url)
        self._task: asyncio.Task[None] | None = None
        self.key = pod_key_prefix(settings.service) + settings.pod

    def record_stats(self, scheduler: SchedulerStats, _iteration: object) -> None:
        """An AsyncLLM stats listener: keeps the latest load and the step's KV events."""
        self.stats = scheduler
        if scheduler.stored_block_hashes or scheduler.evicted_block_hashes:
            self._pending_events.append((scheduler.evicted_block_hashes,
                                         scheduler.stored_block_hashes))

    def record(self) -> PodRecord:
        """The pod's record now, signed when the pod has the service's key."""
        s = self.settings
        record = PodRecord(pod=s.pod, service=s.service, role=s.role, model=self.model,
                           url=s.url, block_size=self.block_size,
                           num_running=self.stats.num_running_reqs,
                           num_waiting=self.stats.num_waiting_reqs,
                           kv_cache_usage=self.stats.kv_cache_usage, updated_at=time.time(),
                           max_model_len=self.max_model_len,
                           max_token_chars=self.max_token_chars)
        return record if s.key is None else sign_record(record, s.key)

    def event_batch(self, evicted: list[bytes], stored: list[bytes]) -> KVEventBatch:
        """One step's KV events as published, signed when the pod has the key."""
        batch = KVEventBatch(self.settings.pod, self.instance_id.encode(), evicted, stored)
        return batch if self.settings.key is None else sign_batch(batch, self.settings.key)

    async def publish(self) -> None:
        ttl_ms = int(REGISTRY_TTL_S * 1000)
        await self._redis.set(self.key, self.record().to_json(), px=ttl_ms)

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh_forever())
        logger.info("registered as %s (%s) in %s", self.key, self.settings.url,
                    _without_password(self.settings.redis_url))

    async def publish_events(self) -> None:
        batches, self._pending_events = self._pending_events, []
        if not batches:
            return
        key = kv_events_key(self.settings.service)
        async with self._redis.pipeline(transaction=False) as pipe:
            for evicted, stored in batches:
                pipe.xadd(key, self.event_batch(evicted, stored).to_fields(),  # type: ignore[arg-type]
                          maxlen=EVENT_STREAM_MAXLEN, approximate=True)
            await pipe.execute()

    async def _refresh_forever(self) -> None:
        ticks_per_refresh = round(REFRESH_INTERVAL_S / EVENT_FLUSH_S)
        tick = 0
        while True:
            try:
                if tick % ticks_per_refresh == 0:
                    await self.publish()
                await self.publish_events()
            except (OSError, RedisError) as exc:
                # Redis being away must not stop serving; the key comes back when it does.
                logger.warning("pod registry: cannot reach Redis: %s", exc)
            tick += 1
            await asyncio.sleep(EVENT_FLUSH_S)

    async def stop(self) -> None:
        """Stops refreshing and deletes the key, so the router stops choosing this pod now."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await self._redis.delete(self.key)
        except (OSError, RedisError) as exc:  # the TTL removes the key anyway
            logger.warning("pod registry: could not remove %s: %s", self.key, exc)
        await self._redis.aclose()


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.split('@', 1)[1]}"
