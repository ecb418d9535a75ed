"""Per-request KV block bookkeeping on top of the block pool.

A request's blocks form its block table, which is append-only while the request runs:
prefix-cache hits come first, then newly allocated blocks. Preemption and finishing free
the whole table.

An encoder-decoder request also owns a cross-attention block table, sized to its encoder
input and allocated with its first self-attention blocks (seed 004: the request's blocks
are |cross table| + |self table|). Cross blocks come from the same pool; the encoder step
writes them once and they are read-only after. They are cached all or nothing under hashes
of the encoder input (`hash_cross_blocks`), so requests with the same encoder input share
them, and no cross block ever matches a decoder block.

Allocation never indexes blocks in the prefix cache: the scheduler calls
`cache_full_blocks` once a step has written them (a block allocated for a step that is
then undone must not be found by a later request).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice, repeat

import numpy as np
from kvferry.engine.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvferry.engine.core.request import Request

from kvferry.protocol.block_hash import hash_cross_blocks, hash_request_blocks


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and tokens found there."""

    queries: int = 0
    hits: int = 0
    requests: int = 0


class KVCacheManager:
    """Allocates, caches and frees the KV blocks of requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_cross_blocks: dict[str, list[KVCacheBlock]] = {}
        # Distinct blocks held by cross-attention tables, kept as tables come and go.
        self.num_cross_blocks_in_use = 0
        # How many leading blocks of each request are already in the prefix-cache index.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """Block ids of a request's table from index `start` on."""
        blocks = self.req_to_blocks.get(request_id, [])
        return [b.block_id for b in blocks[start:]]

    def get_block_id_groups(self, request_id: str) -> list[list[int]]:
        """The request's block ids per group: its self-attention table, then (encoder-decoder
        models) its cross-attention table."""
        groups = [self.get_block_ids(request_id)]
        if request_id in self.req_to_cross_blocks:
            groups.append(self.get_cross_block_ids(request_id))
        return groups

    def get_cross_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_cross_blocks.get(request_id, [])]

    def num_cross_blocks(self, request: Request) -> int:
        """Blocks the request's cross-attention KV takes (0 for a decoder-only request)."""
        return -(-request.num_encoder_tokens // self.block_size)

    def get_cached_cross_blocks(self, request: Request) -> list[KVCacheBlock] | None:
        """Every cross block of the request's encoder input, when the cache holds them all;
        None otherwise (the encoder must run: its output cannot be computed in part)."""
        if not self.enable_caching or request.encoder_key is None:
            return None
        hashes = self._cross_hashes(request)
        blocks = []
        for block_hash in hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                return None
            blocks.append(block)
        return blocks

    def cache_cross_blocks(self, request: Request) -> None:
        """Indexes a request's cross blocks once the encoder step has written them."""
        blocks = self.req_to_cross_blocks.get(request.request_id)
        if not self.enable_caching or not blocks or request.encoder_key is None:
            return
        for block, block_hash in zip(blocks, self._cross_hashes(request)):
            self.block_pool.cache_block(block, block_hash, cross=True)

    def _cross_hashes(self, request: Request) -> list[bytes]:
        if not request.cross_block_hashes:
            assert request.encoder_key is not None
            request.cross_block_hashes = hash_cross_blocks(
                request.encoder_key, self.num_cross_blocks(request))
        return request.cross_block_hashes

    def num_slots(self, request_ids: list[str]) -> np.ndarray:
        """(len(request_ids),) int64: tokens each request's blocks can hold."""
        num = len(request_ids)
        tables = map(self.req_to_blocks.get, request_ids, repeat((), num))
        return np.fromiter(map(len, tables), np.int64, num) * self.block_size

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Indexes the request's blocks that are full once `num_tokens` have KV in the cache.

        Called only after the step that computed them (see the module docstring).
        """
        if self.enable_caching:
            self._cache_full_blocks(request, self.req_to_blocks[request.request_id], num_tokens)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Returns the longest cached prefix of a new request and its length in tokens.

        The hit never covers the whole sequence: its last token is always recomputed, since
        sampling the next token needs that token's logits.
        """
        if not self.enable_caching:
            return [], 0
        hash_request_blocks(
            request.all_token_ids, self.block_size, request.block_hashes, request.cache_salt
        )
        if request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_cache_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admitted request's lookup (a request left waiting is not counted)."""
        if not self.enable_caching:
            return
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += num_tokens
        stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        cross_blocks: list[KVCacheBlock] | None = None,
        num_new_cross_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Makes room for `num_new_tokens` more tokens; None when the pool is too small.

        `new_computed_blocks` are prefix-cache hits of a request scheduled for the first
        time; they join its table ahead of the new blocks. An encoder-decoder request's
        first allocation also gives it its cross table: `cross_blocks` (cached ones) or
        `num_new_cross_blocks` fresh ones, all or nothing together with the self blocks.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if cross_blocks or num_new_cross_blocks:
            return self._allocate_with_cross(
                request, num_new_tokens, new_computed_blocks or [], num_new_computed_tokens,
                cross_blocks or [], num_new_cross_blocks)
        if blocks and not new_computed_blocks:
            # Fast path (most decode steps): the tokens fit the request's last block.
            num_tokens_after = request.num_computed_tokens + num_new_tokens
            if num_tokens_after <= len(blocks) * self.block_size:
                return []
        computed = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-num_tokens_after // self.block_size) - len(blocks) - len(computed)
        # Hits sitting in the free queue leave it when touched, so they count against it too.
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if max(num_required, 0) + num_evictable_hits > self.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(computed)
        blocks.extend(computed)
        new_blocks = self.block_pool.get_new_blocks(max(num_required, 0))
        blocks.extend(new_blocks)
        if computed:
            # Hits are indexed already; the request's own caching starts after them.
            self.num_cached_blocks[request.request_id] = len(computed)
        return new_blocks

    def _allocate_with_cross(
        self,
        request: Request,
        num_new_tokens: int,
        computed: list[KVCacheBlock],
        num_computed_tokens: int,
        cross_hits: list[KVCacheBlock],
        num_new_cross: int,
    ) -> list[KVCacheBlock] | None:
        """A request's first allocation with its cross table (see `allocate_slots`)."""
        req_id = request.request_id
        assert req_id not in self.req_to_cross_blocks, f"{req_id} has a cross table already"
        blocks = self.req_to_blocks.get(req_id, [])
        num_tokens_after = request.num_computed_tokens + num_computed_tokens + num_new_tokens
        num_self = max(-(-num_tokens_after // self.block_size) - len(blocks) - len(computed), 0)
        num_evictable = sum(1 for b in (*computed, *cross_hits) if b.ref_cnt == 0)
        if num_self + num_new_cross + num_evictable > self.num_free_blocks:
            return None
        self.block_pool.touch(cross_hits)
        cross = cross_hits or self.block_pool.get_new_blocks(num_new_cross)
        self.req_to_cross_blocks[req_id] = cross
        for block in cross:
            block.cross_holders += 1
            self.num_cross_blocks_in_use += block.cross_holders == 1
        self.block_pool.touch(computed)
        table = self.req_to_blocks.setdefault(req_id, blocks)
        table.extend(computed)
        new_blocks = self.block_pool.get_new_blocks(num_self)
        table.extend(new_blocks)
        if computed:
            self.num_cached_blocks[req_id] = len(computed)
        return new_blocks

    def allocate_running_slots(
        self, requests: list[Request], num_tokens: list[int]
    ) -> list[list[int]] | None:
        """Grows running requests' tables to hold `num_tokens[i]` tokens each, all at once.

        The step path's allocation: no prefix-cache hits are involved and every request
        already holds blocks. Returns each request's new block ids, or None, with nothing
        allocated, when the pool cannot serve them all.
        """
        block_size, tables = self.block_size, self.req_to_blocks
        counts = [
            -(-n // block_size) - len(tables[r.request_id]) for r, n in zip(requests, num_tokens)
        ]
        if sum(counts) > self.num_free_blocks:
            return None
        new_blocks = iter(self.block_pool.get_new_blocks(sum(counts)))
        new_block_ids = []
        for request, count in zip(requests, counts):
            blocks = list(islice(new_blocks, count))
            tables[request.request_id].extend(blocks)
            new_block_ids.append([b.block_id for b in blocks])
        return new_block_ids

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        """Indexes blocks [cached so far, full at `num_tokens`) under their chained hashes."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        first = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= first:
            return  # no block became full
        hashes = hash_request_blocks(
            request.all_token_ids, self.block_size, request.block_hashes, request.cache_salt
        )
        for i in range(first, num_full):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Releases every block of a request, tail first, so shared prefixes are evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))
        # Cross blocks last: they were allocated first, so they are evicted last.
        cross = self.req_to_cross_blocks.pop(request.request_id, [])
        for block in cross:
            block.cross_holders -= 1
            self.num_cross_blocks_in_use -= block.cross_holders == 0
        self.block_pool.free_blocks(reversed(cross))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
