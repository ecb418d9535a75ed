"""A consumer's side of the leases: heartbeats for holds it will pull, frees for the rest.

From the moment a request with remote KV arrives until its pull is over, a background
thread renews the producer's hold every `heartbeat_s` (one call per producer, naming all of
that producer's requests). A reply saying a hold is gone marks the request lost: its pull
must not be trusted (the producer may have reused the blocks). A hold that ended because
this consumer's own read finished is not lost: a heartbeat sent as the read completes can
reach the producer after the read's notification, before the engine hears of the read. A request that will not be
pulled (cancelled, failed, computed locally) frees its hold at once instead of letting the
lease run out.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from dataclasses import dataclass

from kvferry.kvtransfer.auth import SideChannelAuth
from kvferry.kvtransfer.metrics import KVTransferMetrics
from kvferry.kvtransfer.params import KVTransferParams
from kvferry.kvtransfer.side_channel import SideChannelClient, SideChannelError

logger = logging.getLogger(__name__)

# (host, port, agent name): one producer incarnation.
_Producer = tuple[str, int, str]


@dataclass
class _Tracked:
    producer: _Producer
    # The id the producer holds the blocks under.
    remote_req_id: str
    # A heartbeat reply said the producer no longer holds the blocks.
    lost: bool = False


class LeaseKeeper:
    """Keeps the producer holds of a consumer's waiting requests alive."""

    def __init__(
        self, heartbeat_s: float, timeouts_s: tuple[float, float], metrics: KVTransferMetrics,
        reader: str, auth: SideChannelAuth | None,
    ) -> None:
        self.heartbeat_s = heartbeat_s
        # Each call's connect and read timeouts.
        self.connect_timeout_s, self.timeout_s = timeouts_s
        # This consumer's NIXL agent name: its heartbeats claim the holds they renew.
        self.reader = reader
        self._auth = auth
        self._metrics = metrics
        self._lock = threading.Lock()
        self._tracked: dict[str, _Tracked] = {}
        self._frees: list[tuple[_Producer, str]] = []
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def track(self, req_id: str, params: KVTransferParams) -> None:
        """Starts renewing the hold behind a request's remote KV."""
        producer = (params.remote_host or "", params.remote_port or 0,
                    params.kvferry_agent_name or "")
        with self._lock:
            self._tracked[req_id] = _Tracked(producer, params.remote_request_id or "")
            self._start_locked()

    def untrack(self, req_id: str) -> None:
        """Stops renewing (the pull finished: its notification ended the hold)."""
        with self._lock:
            self._tracked.pop(req_id, None)

    def release(self, req_id: str) -> None:
        """Stops renewing and tells the producer to free the hold now (unless another
        request here was given the same hold: its pull may be reading it)."""
        with self._lock:
            tracked = self._tracked.pop(req_id, None)
            if tracked is None or tracked.lost:
                return
            if any((t.producer, t.remote_req_id) == (tracked.producer, tracked.remote_req_id)
                   for t in self._tracked.values()):
                return
            self._frees.append((tracked.producer, tracked.remote_req_id))
        self._wake.set()

    def is_tracked(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._tracked

    def is_lost(self, req_id: str) -> bool:
        with self._lock:
            tracked = self._tracked.get(req_id)
            return tracked is not None and tracked.lost

    def close(self) -> None:
        """Sends the frees still queued, then stops the thread."""
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=(self.connect_timeout_s + self.timeout_s) * 2)

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvferry-heartbeat", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.heartbeat_s)
            self._wake.clear()
            self._send_frees()
            if self._closed.is_set():
                return
            self._send_heartbeats()

    def _send_frees(self) -> None:
        with self._lock:
            frees, self._frees = self._frees, []
        for producer, req_ids in _by_producer(frees).items():
            try:
                self._client(producer).free(producer[2], req_ids)
            except SideChannelError as e:
                # The lease frees the blocks anyway when it runs out.
                logger.info("could not free %d KV holds on %s: %s", len(req_ids), producer[:2], e)

    def _send_heartbeats(self) -> None:
        with self._lock:
            pending = [(t.producer, t.remote_req_id) for t in self._tracked.values() if not t.lost]
        for producer, req_ids in _by_producer(pending).items():
            try:
                reply = self._client(producer).renew(producer[2], req_ids)
            except SideChannelError as e:
                self._metrics.count_heartbeat_failure()
                logger.info("heartbeat to %s failed: %s", producer[:2], e)
                continue
            # A reply of the wrong length (a broken producer) marks nothing lost: the pull's own
            # renewal checks the hold again before reading.
            held = reply.held if len(reply.held) == len(req_ids) else [True] * len(req_ids)
            # A hold that ended because this consumer's read finished is not lost: the read's
            # completion, which the engine may not have seen yet, is on its way.
            pulled = reply.pulled if len(reply.pulled) == len(req_ids) else [False] * len(req_ids)
            self._mark_lost(producer, [r for r, h, p in zip(req_ids, held, pulled, strict=True)
                                       if not h and not p])

    def _mark_lost(self, producer: _Producer, remote_req_ids: list[str]) -> None:
        lost = set(remote_req_ids)
        with self._lock:
            for tracked in self._tracked.values():
                if tracked.producer == producer and tracked.remote_req_id in lost:
                    tracked.lost = True

    def _client(self, producer: _Producer) -> SideChannelClient:
        return SideChannelClient(producer[0], producer[1], self.timeout_s, self.reader,
                                 self._auth, self.connect_timeout_s)


def _by_producer(items: list[tuple[_Producer, str]]) -> dict[_Producer, list[str]]:
    grouped: dict[_Producer, list[str]] = defaultdict(list)
    for producer, req_id in items:
        grouped[producer].append(req_id)
    return grouped
