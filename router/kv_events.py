"""Reads the engines' KV events from Redis into the router's prefix index."""

from __future__ import annotations

import logging

from kvferry.engine.server.registry import kv_events_key
from kvferry.router.prefix_index import PrefixIndex
from kvferry.router.redis_follower import RedisFollower

logger = logging.getLogger("kvferry.router.kv_events")

HASH_BYTES = 32  # sha256, as engine/kv_cache/hashing.py makes them
BLOCK_MS = 200  # XREAD's wait for new entries


def split_hashes(joined: bytes) -> list[bytes]:
    return [joined[i:i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES)]


class KVEventReader(RedisFollower):
    """Follows the service's KV event stream from its start (so a restarted router relearns
    what the pods hold) and applies each batch: evicted first, then stored.

    A pod whose entries name a new engine instance was restarted under the same name (its
    registry key may never have expired): everything its previous process held is dropped
    from the index before the new instance's entries apply, whether the router sees this
    live or replays the stream later."""

    def __init__(self, redis_url: str, service: str, index: PrefixIndex) -> None:
        super().__init__(redis_url)
        self._key = kv_events_key(service)
        self._index = index
        self._last_id = "0"
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

    def read_failed(self, exc: Exception) -> None:
        logger.warning("KV events: cannot read Redis: %s", exc)
