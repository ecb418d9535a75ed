"""The producer's leases on finished prefills' blocks.

A prefill that will be decoded elsewhere finishes with its blocks held. The hold ends in
exactly one of three ways: the consumer's read finishes (its NIXL notification arrives), the
consumer frees it (it computed locally, failed, or was cancelled), or the lease runs out
(no heartbeat for `lease_s`: the consumer died or forgot). Whichever comes first wins; the
others then find nothing to end. A decode pod that dies therefore strands nothing for longer
than one lease.

A hold serves one reader. The first consumer that renews it (a heartbeat, or the renewal
before its read) claims it; another consumer's renewal is refused and its free ignored, so
it computes the prompt itself. Without this, a decode hop retried on a second pod could read
blocks that the first pod's late notification had just freed for reuse. Every renewal and
free names its reader: one that names none ("") is refused, claimed hold or not, so no
caller can keep a hold alive or end it without being its (would-be) reader.

A hold its reader's read ended is remembered for a lease afterwards, so that a heartbeat
crossing the notification learns the hold ended by its own pull (see `pulled_by`), not that
it was lost.

The table is shared by the scheduler (which starts holds), the side channel's threads
(heartbeats and frees) and the engine thread (notifications and expiry), hence the lock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvferry.kvtransfer.metrics import HoldEnd, KVTransferMetrics
from kvferry.kvtransfer.params import BlockIdGroups

# Finished pulls a table remembers at most (the oldest are forgotten first): a lease of
# them at a very high pull rate, a few MiB.
MAX_REMEMBERED_PULLS = 65536


@dataclass
class Hold:
    """One finished prefill's blocks, kept for a remote pull."""

    req_id: str
    block_ids: BlockIdGroups
    # Monotonic time at which the hold ends unless renewed.
    deadline: float
    # The consumer (its NIXL agent name) that claimed the hold; "" while unclaimed.
    reader: str = ""

    def serves(self, reader: str) -> bool:
        """Whether `reader` may renew or end the hold: its claimer, or anyone named while
        it is unclaimed; "" names no one and is never served."""
        return bool(reader) and (not self.reader or reader == self.reader)

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.block_ids)


class LeaseTable:
    """Holds keyed by request id, each ending once; ended holds wait to be drained."""

    def __init__(
        self,
        lease_s: float,
        metrics: KVTransferMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lease_s = lease_s
        self._metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self._holds: dict[str, Hold] = {}
        # Ended holds whose blocks the scheduler has not yet been told to free.
        self._ended: list[str] = []
        self._num_blocks = 0
        # Holds ended by their reader's finished read: request id -> (reader, monotonic time
        # after which it is forgotten), oldest first.
        self._pulled: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def hold(self, req_id: str, block_ids: BlockIdGroups) -> None:
        """Starts a lease of `lease_s` on a request's blocks."""
        with self._lock:
            if req_id in self._holds:
                raise RuntimeError(f"request {req_id!r} already holds blocks for a transfer")
            held = Hold(req_id, block_ids, self._clock() + self.lease_s)
            self._holds[req_id] = held
            self._pulled.pop(req_id, None)  # a pull of an earlier hold is not this one's
            self._num_blocks += held.num_blocks
            self._metrics.set_blocks_held(self._num_blocks)

    def renew(self, req_ids: Iterable[str], reader: str) -> list[bool]:
        """Extends the given holds by a full lease, claiming unclaimed ones for `reader`.

        Per id, whether it is held for `reader`: False when it ended, never existed, or
        another reader claimed it.
        """
        return [block_ids is not None for block_ids in self.claim(req_ids, reader)]

    def claim(self, req_ids: Iterable[str], reader: str) -> list[BlockIdGroups | None]:
        """`renew`, answering per id with the blocks held for `reader` (None: not held).

        The blocks are what a consumer may read: params naming others are forged or stale.
        """
        with self._lock:
            deadline = self._clock() + self.lease_s
            result: list[BlockIdGroups | None] = []
            for req_id in req_ids:
                held = self._holds.get(req_id)
                if held is None or not held.serves(reader):
                    result.append(None)
                    continue
                held.reader = reader
                held.deadline = max(held.deadline, deadline)
                result.append(held.block_ids)
            return result

    def end(self, req_id: str, how: HoldEnd, reader: str) -> bool:
        """Ends one hold; False when it had already ended, never existed, or is not `reader`'s."""
        with self._lock:
            held = self._holds.get(req_id)
            if held is None or not held.serves(reader):
                return False
            if how is HoldEnd.PULLED:
                self._remember_pulled_locked(req_id, reader)
            return self._end_locked(req_id, how)

    def pulled_by(self, req_ids: Iterable[str], reader: str) -> list[bool]:
        """Per id, whether its hold ended within the last lease because `reader`'s read of
        it finished: a heartbeat that crossed that read's notification finds the hold gone,
        and must not take the blocks it read for lost."""
        with self._lock:
            self._forget_pulled_locked(self._clock())
            return [bool(reader) and self._pulled.get(r, ("", 0.0))[0] == reader
                    for r in req_ids]

    def expire(self) -> list[str]:
        """Ends every hold past its deadline; returns their request ids."""
        with self._lock:
            now = self._clock()
            expired = [r for r, h in self._holds.items() if h.deadline <= now]
            for req_id in expired:
                self._end_locked(req_id, HoldEnd.EXPIRED)
            return expired

    def drain_ended(self) -> list[str]:
        """Request ids whose holds ended since the last call: their blocks may be freed."""
        with self._lock:
            ended, self._ended = self._ended, []
            return ended

    def is_held(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._holds

    def holds_for(self, req_id: str, reader: str) -> bool:
        """Whether `req_id`'s blocks are held, claimed by `reader`."""
        with self._lock:
            held = self._holds.get(req_id)
            return held is not None and bool(reader) and held.reader == reader

    def readers(self) -> dict[str, str]:
        """Request id -> the consumer that claimed its hold, for the claimed holds."""
        with self._lock:
            return {r: h.reader for r, h in self._holds.items() if h.reader}

    @property
    def num_blocks_held(self) -> int:
        with self._lock:
            return self._num_blocks

    def _remember_pulled_locked(self, req_id: str, reader: str) -> None:
        now = self._clock()
        self._forget_pulled_locked(now)
        self._pulled[req_id] = (reader, now + self.lease_s)
        self._pulled.move_to_end(req_id)
        while len(self._pulled) > MAX_REMEMBERED_PULLS:
            self._pulled.popitem(last=False)

    def _forget_pulled_locked(self, now: float) -> None:
        while self._pulled:
            req_id, (_, forget_at) = next(iter(self._pulled.items()))
            if forget_at > now:
                return
            del self._pulled[req_id]

    def _end_locked(self, req_id: str, how: HoldEnd) -> bool:
        held = self._holds.pop(req_id, None)
        if held is None:
            return False
        self._num_blocks -= held.num_blocks
        self._ended.append(req_id)
        self._metrics.set_blocks_held(self._num_blocks)
        self._metrics.count_hold_ended(how)
        return True
