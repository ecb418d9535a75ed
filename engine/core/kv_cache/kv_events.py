"""KV events: the block hashes a pool started and stopped caching, for the router.

The router keeps an index from block hash to the pods that hold it (prefix-aware
routing). The block pool logs each hash it indexes (`stored`) and each one it drops
(`evicted`); the scheduler drains the log into every step's stats, and the server
publishes it to Redis. Within one step evictions happen while scheduling and stores after
the step ran, so a reader applies a batch's `evicted` before its `stored`.
"""

from __future__ import annotations

from kvferry.protocol.block_hash import BlockHash

# Hashes kept between drains; past this the log stops growing (a reader that misses
# events only routes less precisely, and its entries age out).
MAX_PENDING_EVENTS = 65536


class KVEventLog:
    """Hashes stored and evicted since the last `drain`."""

    def __init__(self) -> None:
        self.stored: list[BlockHash] = []
        self.evicted: list[BlockHash] = []

    def record_stored(self, block_hash: BlockHash) -> None:
        if len(self.stored) < MAX_PENDING_EVENTS:
            self.stored.append(block_hash)

    def record_evicted(self, block_hash: BlockHash) -> None:
        if len(self.evicted) < MAX_PENDING_EVENTS:
            self.evicted.append(block_hash)

    def drain(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, evicted) since the last drain; the log starts empty again."""
        stored, evicted = self.stored, self.evicted
        self.stored, self.evicted = [], []
        return stored, evicted
