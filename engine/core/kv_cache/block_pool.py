"""The pool of KV blocks: reference counts, an LRU free queue, and the prefix-cache index.

Invariants:
- Block 0 is the null block: never allocated, never freed, never cached. Block tables pad
  with it.
- A block is in the free queue exactly when its reference count is 0. A free block may
  still hold a cached prefix (it keeps its hash) until it is handed out again; handing it
  out evicts it from the index.
- The free queue is LRU: freed blocks go to the tail, allocation takes from the head.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvferry.engine.core.kv_cache.kv_events import KVEventLog

from kvferry.protocol.block_hash import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block holds a full, hashed block of some request's tokens.
    block_hash: BlockHash | None = None
    # The hash is a cross-attention block's (an encoder input's), not a decoder block's.
    is_cross: bool = False
    # Cross-attention tables holding the block (KVCacheManager counts blocks in use by it).
    cross_holders: int = 0
    # Links of the free queue (None when not in it, or at an end).
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt})"


class FreeBlockQueue:
    """A doubly linked list of free blocks, so a cache hit can take a block from the middle."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise RuntimeError("no free blocks left; check get_num_free_blocks() first")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, block
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Block ids from head (next to be evicted) to tail; for tests and debugging."""
        ids = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """Owns every KV block; hands them out and takes them back."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # What the router's prefix index learns from this pool (see kv_events.py).
        self.events = KVEventLog()

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of allocatable blocks in use (0.0 - 1.0)."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes `num_blocks` blocks from the head of the free queue, evicting their prefixes."""
        if num_blocks > self.get_num_free_blocks():
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.get_num_free_blocks()} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds a reference to cached blocks a request reuses (taking free ones off the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drops a reference; blocks that reach zero join the tail of the free queue in order."""
        for block in blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash,
                    cross: bool = False) -> None:
        """Indexes a full block under its hash (the first block with a hash keeps it);
        `cross`: a cross-attention block (its event goes apart from the decoder's)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.is_cross = cross
        if self.cached_blocks.setdefault(block_hash, block) is block:
            self.events.record_stored(block_hash, cross)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
            self.events.record_evicted(block.block_hash, block.is_cross)
        block.block_hash = None
        block.is_cross = False

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; only possible when no block is in use."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block_hash, block in self.cached_blocks.items():
            self.events.record_evicted(block_hash, block.is_cross)
        for block in self.blocks:
            block.block_hash = None
            block.is_cross = False
        self.cached_blocks.clear()
        return True
