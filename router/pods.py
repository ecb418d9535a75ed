"""The router's view of the pods: the registry in Redis, reread every poll interval.

A pod whose key expired is gone at the next poll. A pod that refused a connection is
set aside locally for a short while, so requests do not keep trying it until its key
expires. A record that does not verify with the service's key, or holds values no pod
publishes, is no pod at all (kvferry.protocol.record_auth): it is ignored and counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvferry.kvtransfer.auth import TransferKey
from kvferry.router.redis_follower import RedisFollower

from kvferry.protocol.record_auth import Rejection, check_record
from kvferry.protocol.registry import PodRecord, pod_key_prefix

logger = logging.getLogger("kvferry.router.pods")

# A pod that failed a connection is not chosen for this long (unless nothing else is left).
FAILED_POD_COOLDOWN_S = 5.0
# Which pool a registered role serves in: a `both` pod is the decode pool of a
# colocated service (the operator names its single pool `decode`).
ROLE_POOL = {"both": "decode", "decode": "decode", "prefill": "prefill", "encoder": "encoder"}


@dataclass
class Pod:
    """One live pod: its latest record plus what this router counts itself."""

    record: PodRecord
    # Requests this router has in flight on the pod (fresher than the pod's own numbers).
    num_routed: int = 0

    @property
    def name(self) -> str:
        return self.record.pod

    @property
    def url(self) -> str:
        return self.record.url

    @property
    def pool(self) -> str:
        return ROLE_POOL.get(self.record.role, "decode")


class PodDirectory(RedisFollower):
    """Live pods by pool, refreshed from the registry in the background."""

    def __init__(self, redis_url: str, service: str, poll_s: float,
                 key: TransferKey | None = None,
                 on_reject: Callable[[Rejection], None] | None = None) -> None:
        super().__init__(redis_url)
        self._prefix = pod_key_prefix(service)
        # Records must verify with it; None (an insecure setup) takes unsigned ones.
        self._transfer_key = key
        # Called once per rejected registry value (a metric), not once per poll.
        self._on_reject = on_reject
        # Registry key -> the rejected value last seen under it, so that a record rewritten
        # every refresh is counted per new value, and one left in place is counted once.
        self._rejected: dict[bytes, bytes] = {}
        self.pause_s = self.retry_s = poll_s
        self._pods: dict[str, Pod] = {}
        # pool -> its pods, rebuilt at each registry read (requests read it, never build it).
        self._by_pool: dict[str, list[Pod]] = {}
        self._failed_until: dict[str, float] = {}
        self.is_connected = False
        # Pools that have had a live pod since the router started: an empty one is down.
        self.seen_pools: set[str] = set()
        # Called with a pod's name when it leaves (its caches are gone with it).
        self.on_leave: list[Callable[[str], None]] = []

    # ------------------------------------------------------------------ reading
    def pool(self, name: str) -> list[Pod]:
        """Live pods of a pool, without those that failed lately unless no other is left.
        The list may be shared: callers must not change it."""
        pods = self._by_pool.get(name, [])
        if not self._failed_until:  # the usual case, on every request: no filtering
            return pods
        now = time.monotonic()
        healthy = [p for p in pods if self._failed_until.get(p.name, 0.0) <= now]
        return healthy or pods

    def pools(self) -> dict[str, list[str]]:
        """pool -> names of its live pods (for /health)."""
        out: dict[str, list[str]] = {}
        for pod in self._pods.values():
            out.setdefault(pod.pool, []).append(pod.name)
        return {k: sorted(v) for k, v in sorted(out.items())}

    def get(self, name: str) -> Pod | None:
        return self._pods.get(name)

    def mark_failed(self, pod: Pod) -> None:
        self._failed_until[pod.name] = time.monotonic() + FAILED_POD_COOLDOWN_S

    # ------------------------------------------------------------------ refreshing
    async def refresh(self) -> None:
        keys = [k async for k in self._redis.scan_iter(match=self._prefix + "*", count=1000)]
        values = await self._redis.mget(keys) if keys else []
        records = {}
        rejected: dict[bytes, bytes] = {}
        now = time.time()
        for key, raw in zip(keys, values):
            if raw is None:  # expired between SCAN and MGET
                continue
            parsed = self._parse(key, raw, now)
            if isinstance(parsed, Rejection):
                if self._rejected.get(key) != raw:
                    self._reject(key, parsed)
                rejected[key] = raw
                continue
            records[parsed.pod] = parsed
        self._rejected = rejected
        self._apply(records)
        self.is_connected = True

    def _parse(self, key: bytes, raw: bytes, now: float) -> PodRecord | Rejection:
        """The record when the router may use it; else why not."""
        try:
            record = PodRecord.from_json(raw)
        except ValueError:
            return Rejection.MALFORMED
        # A record filed under another pod's key would make one pod count twice.
        if not isinstance(record.pod, str) or key != (self._prefix + record.pod).encode():
            return Rejection.MALFORMED
        return check_record(record, self._transfer_key, now) or record

    def _reject(self, key: bytes, why: Rejection) -> None:
        # The key's name only: the value is whatever its writer chose to put there.
        logger.warning("pod registry: ignoring %s (%s)", key.decode(errors="replace"),
                       why.value)
        if self._on_reject is not None:
            self._on_reject(why)

    def _apply(self, records: dict[str, PodRecord]) -> None:
        for name in self._pods.keys() - records.keys():
            logger.info("pod %s left (%s)", name, self._pods[name].url)
            del self._pods[name]
            for listener in self.on_leave:
                listener(name)
        for name, record in records.items():
            pod = self._pods.get(name)
            if pod is None:
                logger.info("pod %s joined the %s pool (%s)", name, ROLE_POOL.get(record.role),
                            record.url)
                self._pods[name] = Pod(record)
                self.seen_pools.add(self._pods[name].pool)
            else:
                pod.record = record
        by_pool: dict[str, list[Pod]] = {}
        for pod in self._pods.values():
            by_pool.setdefault(pod.pool, []).append(pod)
        self._by_pool = by_pool
        now = time.monotonic()
        self._failed_until = {n: t for n, t in self._failed_until.items() if t > now}

    async def read_once(self) -> None:
        await self.refresh()

    def read_failed(self, exc: Exception) -> None:
        # Keep the last view: pods keep serving while Redis is briefly away.
        if self.is_connected:
            logger.warning("pod registry: cannot read Redis: %s", exc)
        self.is_connected = False
