"""Reads the engines' KV events from Redis into the router's prefix index."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvferry.kvtransfer.auth import TransferKey
from kvferry.router.prefix_index import PrefixIndex
from kvferry.router.redis_follower import RedisFollower

from kvferry.protocol.kv_events import KVEventBatch, kv_events_key
from kvferry.protocol.record_auth import Rejection, check_batch

logger = logging.getLogger("kvferry.router.kv_events")

BLOCK_MS = 200  # XREAD's wait for new entries


class KVEventReader(RedisFollower):
    """Follows the service's KV event stream from its start (so a restarted router relearns
    what the pods hold) and applies each batch: evicted first, then stored (the decoder's
    blocks to the prefix index, cross-attention blocks to the cross index).

    A pod whose entries name a new engine instance was restarted under the same name (its
    registry key may never have expired): everything its previous process held is dropped
    from the index before the new instance's entries apply, whether the router sees this
    live or replays the stream later.

    With the service's key, an entry that does not verify is skipped whole: it neither
    adds nor removes blocks, nor passes for a pod's restart."""

    def __init__(self, redis_url: str, service: str, index: PrefixIndex,
                 key: TransferKey | None = None,
                 on_reject: Callable[[Rejection], None] | None = None,
                 cross_index: PrefixIndex | None = None) -> None:
        super().__init__(redis_url)
        self._transfer_key = key
        self._on_reject = on_reject
        self._key = kv_events_key(service)
        self._index = index
        # Cross-attention block hashes (encoder-decoder models), kept apart: which decode
        # pod holds an encoder input's cross blocks, not which holds a prompt prefix.
        self._cross_index = cross_index if cross_index is not None else PrefixIndex()
        self._last_id = "0"
        self.num_events = 0
        # pod -> the engine instance its latest entry came from.
        self._instances: dict[str, bytes] = {}

    def apply(self, fields: dict[bytes, bytes]) -> None:
        try:
            batch = KVEventBatch.from_fields(fields)
        except ValueError as exc:
            logger.warning("KV events: skipping an entry: %s", exc)
            self._reject(Rejection.MALFORMED)
            return
        why = check_batch(batch, self._transfer_key)
        if why is not None:
            logger.warning("KV events: skipping an entry for pod %r (%s)", batch.pod, why.value)
            self._reject(why)
            return
        if batch.instance is not None:  # engines from before instance ids send none
            self._follow_instance(batch.pod, batch.instance)
        self._index.evicted(batch.pod, batch.evicted)
        self._index.stored(batch.pod, batch.stored)
        if batch.cross_evicted or batch.cross_stored:
            self._cross_index.evicted(batch.pod, batch.cross_evicted)
            self._cross_index.stored(batch.pod, batch.cross_stored)
        self.num_events += 1

    def _reject(self, why: Rejection) -> None:
        if self._on_reject is not None:
            self._on_reject(why)

    def _follow_instance(self, pod: str, instance: bytes) -> None:
        previous = self._instances.get(pod)
        self._instances[pod] = instance
        if previous is not None and previous != instance:
            logger.info("pod %s restarted (engine instance %s): its prefix cache is empty",
                        pod, instance.decode(errors="replace"))
            self._index.forget_pod(pod)
            self._cross_index.forget_pod(pod)

    async def read_once(self) -> None:
        answer = await self._redis.xread({self._key: self._last_id}, count=1000, block=BLOCK_MS)
        for _stream, entries in answer or ():
            for entry_id, fields in entries:
                self.apply(fields)
                self._last_id = entry_id

    def read_failed(self, exc: Exception) -> None:
        logger.warning("KV events: cannot read Redis: %s", exc)
