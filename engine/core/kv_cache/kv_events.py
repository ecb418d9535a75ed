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
    """Hashes stored and evicted since the last `drain`; cross-attention blocks' hashes
    (encoder-decoder models) apart from the decoder's."""

    def __init__(self) -> None:
        self.stored: list[BlockHash] = []
        self.evicted: list[BlockHash] = []
        self.cross_stored: list[BlockHash] = []
        self.cross_evicted: list[BlockHash] = []

    def record_stored(self, block_hash: BlockHash, cross: bool = False) -> None:
        log = self.cross_stored if cross else self.stored
        if len(log) < MAX_PENDING_EVENTS:
            log.append(block_hash)

    def record_evicted(self, block_hash: BlockHash, cross: bool = False) -> None:
        log = self.cross_evicted if cross else self.evicted
        if len(log) < MAX_PENDING_EVENTS:
            log.append(block_hash)

    def drain(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, evicted) decoder hashes since the last drain; that log starts empty."""
        stored, evicted = self.stored, self.evicted
        self.stored, self.evicted = [], []
        return stored, evicted

    def drain_cross(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, evicted) cross-attention hashes since the last drain."""
        stored, evicted = self.cross_stored, self.cross_evicted
        self.cross_stored, self.cross_evicted = [], []
        return stored, evicted
