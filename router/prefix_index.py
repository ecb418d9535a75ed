"""Which pod holds which prompt prefix: block hash -> pods, for prefix-aware routing.

Prompts are hashed block by block with the engine's own function
(`kvferry.protocol.block_hash.hash_request_blocks`), so a hash here equals the hash
the pod's block pool stores. The index is fed by the router's own placements (the pod a
prompt went to computes and caches its full blocks) and by KV events the engines publish
(`stored` and `evicted` hashes); entries age out so a pod's evictions the router never
heard of stop attracting traffic.
"""

from __future__ import annotations

import time

from kvferry.protocol.block_hash import BlockHash, hash_request_blocks

# An entry not refreshed for this long is dropped (the pod has likely evicted it).
ENTRY_TTL_S = 600.0
MAX_ENTRIES = 1_000_000


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[BlockHash]:
    """The chained hashes of the prompt's full blocks, exactly as the engine computes them."""
    return hash_request_blocks(token_ids, block_size, [])


class PrefixIndex:
    """block hash -> {pod name: last time it was known to hold the block}."""

    def __init__(self, ttl_s: float = ENTRY_TTL_S) -> None:
        self._holders: dict[BlockHash, dict[str, float]] = {}
        self._ttl_s = ttl_s

    def __len__(self) -> int:
        return len(self._holders)

    def stored(self, pod: str, hashes: list[BlockHash]) -> None:
        now = time.monotonic()
        if len(self._holders) + len(hashes) > MAX_ENTRIES:
            self._drop_expired(now)
        for h in hashes:
            self._holders.setdefault(h, {})[pod] = now

    def evicted(self, pod: str, hashes: list[BlockHash]) -> None:
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None:
                holders.pop(pod, None)
                if not holders:
                    del self._holders[h]

    def forget_pod(self, pod: str) -> None:
        for h in [h for h, holders in self._holders.items() if pod in holders]:
            self.evicted(pod, [h])

    def num_leading_blocks(self, hashes: list[BlockHash], pods: list[str]) -> dict[str, int]:
        """pod -> how many of the leading blocks of `hashes` it holds (a chain: the first
        block it lacks ends its match, since later hashes cover that block too)."""
        now = time.monotonic()
        matched = dict.fromkeys(pods, 0)
        alive = set(pods)
        for h in hashes:
            holders = self._holders.get(h, {})
            alive = {p for p in alive if now - holders.get(p, -1e18) <= self._ttl_s}
            if not alive:
                break
            for p in alive:
                matched[p] += 1
        return matched

    def _drop_expired(self, now: float) -> None:
        for h in list(self._holders):
            holders = {p: t for p, t in self._holders[h].items() if now - t <= self._ttl_s}
            if holders:
                self._holders[h] = holders
            else:
                del self._holders[h]
