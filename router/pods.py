"""The router's view of the pods: the registry in Redis, reread every poll interval.

A pod leaves the view in one of three ways, each counted by `on_drop(pool, reason)`:

- `left`: its record says it is leaving (it drains, or its engine died): at once.
- `refused`: connecting to it failed (refused, unreachable): at once. Its record, still in
  Redis until it expires, does not bring it back; a newer record does (the pod is back).
- `expired`: its record has been missing from the registry for the grace period. A record
  can be late without the pod being gone (a refresh held up on a loaded machine, Redis
  restarted and not yet refilled), and a pod that serves keeps serving meanwhile.

A pod that failed otherwise (a timeout, a 5xx) is set aside locally for a short while, so
requests do not keep trying it. A record that does not verify with the service's key, or
holds values no pod publishes, is no pod at all (kvferry.protocol.record_auth): it is
ignored and counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvferry.kvtransfer.auth import TransferKey
from kvferry.router.config import DEFAULT_POD_GRACE_S
from kvferry.router.redis_follower import RedisFollower

from kvferry.protocol.record_auth import Rejection, check_record
from kvferry.protocol.registry import PodRecord, pod_key_prefix

logger = logging.getLogger("kvferry.router.pods")

# A pod that failed a request is not chosen for this long (unless nothing else is left).
FAILED_POD_COOLDOWN_S = 5.0
# Why a pod left the router's view (a metric label).
LEFT, REFUSED, EXPIRED = "left", "refused", "expired"
# Which pool a registered role serves in: a `both` pod is the decode pool of a
# colocated service (the operator names its single pool `decode`).
ROLE_POOL = {"both": "decode", "decode": "decode", "prefill": "prefill", "encoder": "encoder"}


@dataclass
class Pod:
    """One live pod: its latest record plus what this router counts itself."""

    record: PodRecord
    # Requests this router has in flight on the pod (fresher than the pod's own numbers).
    num_routed: int = 0
    # time.monotonic() of the first registry read that lacked the pod's record since it
    # was last there; None while it is there.
    missing_since: float | None = None

    @property
    def name(self) -> str:
        return self.record.pod

    @property
    def url(self) -> str:
        return self.record.url

    @property
    def pool(self) -> str:
        return ROLE_POOL.get(self.record.role, "decode")


@dataclass
class Refusal:
    """A pod dropped because no connection could be opened to it."""

    updated_at: float  # of its last record: read again, it does not bring the pod back
    dropped_at: float  # time.monotonic() of the drop
    # Whether a registry read begun after the drop has set `updated_at` (the pod may have
    # refreshed its record between the router's last read and its death).
    is_settled: bool = False


class PodDirectory(RedisFollower):
    """Live pods by pool, refreshed from the registry in the background."""

    def __init__(self, redis_url: str, service: str, poll_s: float,
                 key: TransferKey | None = None,
                 on_reject: Callable[[Rejection], None] | None = None,
                 grace_s: float = DEFAULT_POD_GRACE_S,
                 on_drop: Callable[[str, str], None] | None = None) -> None:
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
        # A pod whose record is missing stays routable this long.
        self.grace_s = grace_s
        # Called with (pool, reason) each time a pod leaves the view (a metric).
        self._on_drop = on_drop
        self._pods: dict[str, Pod] = {}
        # Pods dropped for a failed connection: their record, read again, does not bring
        # them back; a newer one does.
        self._refused: dict[str, Refusal] = {}
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

    @property
    def num_late(self) -> int:
        """Pods kept in the view though their record is missing (within the grace period)."""
        return sum(1 for pod in self._pods.values() if pod.missing_since is not None)

    def mark_failed(self, pod: Pod) -> None:
        self._failed_until[pod.name] = time.monotonic() + FAILED_POD_COOLDOWN_S

    def drop_unreachable(self, pod: Pod) -> None:
        """Drops a pod that a connection could not be opened to, until it publishes a newer
        record. A no-op for a pod already dropped (requests in flight on it fail alike)."""
        if self._pods.get(pod.name) is not pod:
            return
        self._refused[pod.name] = Refusal(pod.record.updated_at, time.monotonic())
        self._drop(pod.name, REFUSED)
        self._index_pools()

    # ------------------------------------------------------------------ refreshing
    async def refresh(self) -> None:
        started = time.monotonic()
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
        self._apply(records, started)
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

    def _apply(self, records: dict[str, PodRecord], now: float) -> None:
        """Brings the view up to date with one registry read, begun at `now` (monotonic)."""
        for name, record in records.items():
            if record.is_leaving:
                self._refused.pop(name, None)
                if name in self._pods:
                    self._drop(name, LEFT)
            elif self._is_still_refused(name, record, now):
                continue
            else:
                self._update(name, record)
        self._refused = {n: r for n, r in self._refused.items() if n in records}
        for name in self._pods.keys() - records.keys():
            self._miss(name, now)
        self._index_pools()
        self._failed_until = {n: t for n, t in self._failed_until.items() if t > now}

    def _is_still_refused(self, name: str, record: PodRecord, read_at: float) -> bool:
        """True while the registry holds the last record of a pod dropped for a failed
        connection (a dead pod's record lives on until it expires); a newer record, written
        since, brings it back.

        The record the router had at the drop may not be the pod's last: the pod can have
        refreshed it after that read and then died. So the first read begun after the drop
        settles which record is the last one, and only a record other than that is newer.
        """
        refusal = self._refused.get(name)
        if refusal is None:
            return False
        if not refusal.is_settled:
            if read_at > refusal.dropped_at:
                refusal.updated_at, refusal.is_settled = record.updated_at, True
            return True
        if record.updated_at == refusal.updated_at:
            return True
        del self._refused[name]
        return False

    def _update(self, name: str, record: PodRecord) -> None:
        pod = self._pods.get(name)
        if pod is None:
            logger.info("pod %s joined the %s pool (%s)", name, ROLE_POOL.get(record.role),
                        record.url)
            pod = self._pods[name] = Pod(record)
            self.seen_pools.add(pod.pool)
            return
        if pod.missing_since is not None:
            logger.info("pod %s is back in the registry", name)
            pod.missing_since = None
        pod.record = record

    def _miss(self, name: str, now: float) -> None:
        """The pod's record is not in the registry: late until the grace period is over."""
        pod = self._pods[name]
        if pod.missing_since is None:
            pod.missing_since = now
            if self.grace_s > 0:
                logger.warning("pod %s: its registry record is late; still routable for "
                               "%g s", name, self.grace_s)
        if now - pod.missing_since >= self.grace_s:
            self._drop(name, EXPIRED)

    def _drop(self, name: str, reason: str) -> None:
        """Removes the pod from the view (`_index_pools` must follow)."""
        pod = self._pods.pop(name)
        logger.info("pod %s left the %s pool (%s): %s", name, pod.pool, pod.url, reason)
        for listener in self.on_leave:
            listener(name)
        if self._on_drop is not None:
            self._on_drop(pod.pool, reason)

    def _index_pools(self) -> None:
        by_pool: dict[str, list[Pod]] = {}
        for pod in self._pods.values():
            by_pool.setdefault(pod.pool, []).append(pod)
        self._by_pool = by_pool

    async def read_once(self) -> None:
        await self.refresh()

    def read_failed(self, exc: Exception) -> None:
        # Keep the last view: pods keep serving while Redis is briefly away.
        if self.is_connected:
            logger.warning("pod registry: cannot read Redis: %s", exc)
        self.is_connected = False
