"""Reads the engines' KV events from Redis into the router's prefix index."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvferry.engine.server.registry import kv_events_key
from kvferry.router.prefix_index import PrefixIndex
from redis.exceptions import RedisError

logger = logging.getLogger("kvferry.router.kv_events")

HASH_BYTES = 32  # sha256, as engine/kv_cache/hashing.py makes them
BLOCK_MS = 200  # XREAD's wait for new entries
RETRY_S = 1.0


def split_hashes(joined: bytes) -> list[bytes]:
    return [joined[i:i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES)]


class KVEventReader:
    """Follows the service's KV event stream from its start (so a restarted router relearns
    what the pods hold) and applies each batch: evicted first, then stored.

    A pod whose entries name a new engine instance was restarted under the same name (its
    registry key may never have expired): everything its previous process held is dropped
    from the index before the new instance's entries apply, whether the router sees this
    live or replays the stream later."""

    def __init__(self, redis_url: str, service: str, index: PrefixIndex) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(redis_url)
        self._key = kv_events_key(service)
        self._index = index
        self._last_id = "0"
        self._task: asyncio.Task[None] | None = None
        self.num_events = 0
        # pod -> the engine instance its latest entry came from.
        self._instances: dict[str, bytes] = {}

    def apply(self, fields: dict[bytes, bytes]) -> None:
        pod = fields[b"pod"].decode()
        instance = fields.get(b"instance")
        if instance is not None:  # engines from before instance ids send none
            self._follow_instance(pod, instance)
        self._index.evicted(pod, split_hashes(fields.get(b"evicted", b"")))
        self._index.stored(pod, split_hashes(fields.get(b"stored", b"")))
        self.num_events += 1

    def _follow_instance(self, pod: str, instance: bytes) -> None:
        previous = self._instances.get(pod)
        self._instances[pod] = instance
        if previous is not None and previous != instance:
            logger.info("pod %s restarted (engine instance %s): its prefix cache is empty",
                        pod, instance.decode(errors="replace"))
            self._index.forget_pod(pod)

    async def read_once(self) -> None:
        answer = await self._redis.xread({self._key: self._last_id}, count=1000, block=BLOCK_MS)
        for _stream, entries in answer or ():
            for entry_id, fields in entries:
                self.apply(fields)
                self._last_id = entry_id

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        while True:
            try:
                await self.read_once()
            except (OSError, RedisError) as exc:
                logger.warning("KV events: cannot read Redis: %s", exc)
                await asyncio.sleep(RETRY_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._redis.aclose()
