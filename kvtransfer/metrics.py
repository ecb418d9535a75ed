"""Counters the transfer layer keeps, for a server to export (names in ARCHITECTURE.md).

Plain numbers behind one lock: the engine thread, the side channel's threads and the
heartbeat thread all count. `snapshot()` gives a consistent copy to export.
"""

from __future__ import annotations

import enum
import threading
from bisect import bisect_left
from dataclasses import dataclass, field

# Upper bounds (seconds) of the pull-duration histogram buckets; +Inf is implied.
PULL_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class FailureReason(enum.StrEnum):
    """Why a pull failed; the label of `kvferry:kv_transfer_failures_total`."""

    # Params that cannot describe a pull into this engine (too few blocks, ids out of range).
    INVALID_PARAMS = "invalid_params"
    # The side channel did not answer (refused, timed out, bad reply).
    PRODUCER_UNREACHABLE = "producer_unreachable"
    # The producer's layout, model or protocol differs from ours.
    INCOMPATIBLE = "incompatible"
    # The producer restarted since it computed the blocks: they are gone.
    PRODUCER_RESTARTED = "producer_restarted"
    # The producer no longer holds the blocks (lease ended, or it never had them).
    LEASE_LOST = "lease_lost"
    # NIXL reported an error for the read.
    TRANSFER_ERROR = "transfer_error"
    # The read did not finish within pull_timeout_s.
    TIMEOUT = "timeout"
    # The params were not signed with this service's transfer key (no, or a wrong,
    # kvferry_mac), or a side channel's reply was not: nothing they name was contacted.
    BAD_SIGNATURE = "bad_signature"
    # Signed params past their kvferry_expires_at: the producer has freed the blocks.
    PARAMS_EXPIRED = "params_expired"


class HoldEnd(enum.StrEnum):
    """How a producer's hold on a finished prefill's blocks ended."""

    # The consumer's read finished and its notification arrived.
    PULLED = "pulled"
    # The consumer said it will not pull (cancelled, failed, or computed locally).
    FREED = "freed"
    # No pull and no heartbeat within the lease.
    EXPIRED = "expired"


@dataclass
class KVTransferStats:
    """A consistent copy of the counters."""

    # Bytes this engine pulled (kvferry:kv_transfer_bytes_total).
    bytes_pulled: int = 0
    pulls_finished: int = 0
    # Descriptors of all pulls started (runs of consecutive blocks).
    descriptors: int = 0
    # Sum and bucket counts (not cumulative) of pull durations (kvferry:kv_transfer_seconds).
    pull_seconds_sum: float = 0.0
    pull_seconds_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(PULL_SECONDS_BUCKETS) + 1)
    )
    # Failed pulls by reason (kvferry:kv_transfer_failures_total).
    failures: dict[str, int] = field(default_factory=dict)
    # Blocks this engine holds for remote pulls (kvferry:kv_blocks_held_for_transfer).
    blocks_held: int = 0
    # Holds ended by lease expiry (kvferry:kv_lease_expirations_total).
    lease_expirations: int = 0
    # Holds ended by the consumer's notification (a finished pull) or its free message.
    sends_pulled: int = 0
    sends_freed: int = 0
    # Heartbeats sent by this engine that the producer did not answer.
    heartbeat_failures: int = 0
    # Of the bytes pulled, those of cross-attention blocks (encoder-decoder models), and
    # the seconds of the pulls that moved them.
    cross_bytes_pulled: int = 0
    cross_pull_seconds_sum: float = 0.0
    cross_pulls_finished: int = 0


class KVTransferMetrics:
    """Thread-safe counters of one engine's transfer layer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVTransferStats()

    def observe_pull(self, num_bytes: int, seconds: float) -> None:
        with self._lock:
            s = self._stats
            s.bytes_pulled += num_bytes
            s.pulls_finished += 1
            s.pull_seconds_sum += seconds
            s.pull_seconds_buckets[bisect_left(PULL_SECONDS_BUCKETS, seconds)] += 1

    def observe_cross_pull(self, num_bytes: int, seconds: float) -> None:
        with self._lock:
            s = self._stats
            s.cross_bytes_pulled += num_bytes
            s.cross_pull_seconds_sum += seconds
            s.cross_pulls_finished += 1

    def count_descriptors(self, num: int) -> None:
        with self._lock:
            self._stats.descriptors += num

    def count_failure(self, reason: FailureReason) -> None:
        with self._lock:
            failures = self._stats.failures
            failures[reason.value] = failures.get(reason.value, 0) + 1

    def set_blocks_held(self, num: int) -> None:
        with self._lock:
            self._stats.blocks_held = num

    def count_hold_ended(self, how: HoldEnd) -> None:
        with self._lock:
            s = self._stats
            if how is HoldEnd.EXPIRED:
                s.lease_expirations += 1
            elif how is HoldEnd.PULLED:
                s.sends_pulled += 1
            else:
                s.sends_freed += 1

    def count_heartbeat_failure(self) -> None:
        with self._lock:
            self._stats.heartbeat_failures += 1

    def snapshot(self) -> KVTransferStats:
        with self._lock:
            s = self._stats
            return KVTransferStats(
                bytes_pulled=s.bytes_pulled, pulls_finished=s.pulls_finished,
                descriptors=s.descriptors, pull_seconds_sum=s.pull_seconds_sum,
                pull_seconds_buckets=list(s.pull_seconds_buckets), failures=dict(s.failures),
                blocks_held=s.blocks_held, lease_expirations=s.lease_expirations,
                sends_pulled=s.sends_pulled, sends_freed=s.sends_freed,
                heartbeat_failures=s.heartbeat_failures,
                cross_bytes_pulled=s.cross_bytes_pulled,
                cross_pull_seconds_sum=s.cross_pull_seconds_sum,
                cross_pulls_finished=s.cross_pulls_finished,
            )
