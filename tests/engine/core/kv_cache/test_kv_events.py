"""KV events: the block pool logs the hashes it starts and stops caching, exactly once."""

from kvferry.engine.core.kv_cache.block_pool import BlockPool
from kvferry.engine.core.kv_cache.kv_events import MAX_PENDING_EVENTS, KVEventLog

from kvferry.protocol.block_hash import ROOT_HASH, hash_block_tokens


def test_cached_blocks_are_logged_as_stored_and_evictions_as_evicted() -> None:
    pool = BlockPool(3, enable_caching=True)  # blocks 1 and 2 are usable
    first, second = pool.get_new_blocks(2)
    h1, h2 = hash_block_tokens(ROOT_HASH, [1, 2]), hash_block_tokens(ROOT_HASH, [3, 4])
    pool.cache_block(first, h1)
    pool.cache_block(second, h1)  # a second block with the same hash indexes nothing new
    assert pool.events.drain() == ([h1], [])
    pool.free_blocks([first, second])
    (reused,) = pool.get_new_blocks(1)  # LRU: block 1, which held h1, is evicted
    assert reused is first
    pool.cache_block(reused, h2)
    assert pool.events.drain() == ([h2], [h1])
    assert pool.events.drain() == ([], [])


def test_reset_evicts_every_cached_hash() -> None:
    pool = BlockPool(3, enable_caching=True)
    block, = pool.get_new_blocks(1)
    h = hash_block_tokens(ROOT_HASH, [7])
    pool.cache_block(block, h)
    pool.free_blocks([block])
    pool.events.drain()
    assert pool.reset_prefix_cache()
    assert pool.events.drain() == ([], [h])


def test_without_prefix_caching_nothing_is_logged() -> None:
    pool = BlockPool(3, enable_caching=False)
    block, = pool.get_new_blocks(1)
    pool.cache_block(block, hash_block_tokens(ROOT_HASH, [7]))
    assert pool.events.drain() == ([], [])


def test_the_log_stops_growing_at_its_bound() -> None:
    log = KVEventLog()
    for i in range(MAX_PENDING_EVENTS + 5):
        log.record_stored(i.to_bytes(32, "big"))
    stored, _ = log.drain()
    assert len(stored) == MAX_PENDING_EVENTS
