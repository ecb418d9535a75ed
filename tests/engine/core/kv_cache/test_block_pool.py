"""BlockPool: the null block, the LRU free queue, reference counts and the prefix index."""

import pytest
from kvferry.engine.core.kv_cache.block_pool import BlockPool, KVCacheBlock

from kvferry.protocol.block_hash import ROOT_HASH, hash_block_tokens


def make_pool(num_blocks: int = 6, enable_caching: bool = True) -> BlockPool:
    return BlockPool(num_blocks, enable_caching)


def make_hash(*token_ids: int) -> bytes:
    return hash_block_tokens(ROOT_HASH, list(token_ids))


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_rejects_pool_without_room_for_a_real_block() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1, enable_caching=True)


def test_null_block_is_reserved_and_never_handed_out() -> None:
    pool = make_pool(num_blocks=4)
    assert pool.null_block.block_id == 0
    assert pool.free_queue.block_ids() == [1, 2, 3]
    assert pool.get_num_free_blocks() == 3
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert pool.get_num_free_blocks() == 0
    with pytest.raises(RuntimeError, match="asked for 1 blocks, 0 free"):
        pool.get_new_blocks(1)


def test_freeing_the_null_block_is_a_no_op() -> None:
    pool = make_pool(num_blocks=3)
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0
    assert pool.free_queue.block_ids() == [1, 2]


def test_allocation_takes_from_the_head_of_the_free_queue() -> None:
    pool = make_pool(num_blocks=6)
    first = pool.get_new_blocks(2)
    assert ids(first) == [1, 2]
    assert [b.ref_cnt for b in first] == [1, 1]
    assert pool.free_queue.block_ids() == [3, 4, 5]
    assert ids(pool.get_new_blocks(1)) == [3]
    assert pool.free_queue.block_ids() == [4, 5]


def test_asking_for_more_blocks_than_free_takes_none() -> None:
    pool = make_pool(num_blocks=4)
    with pytest.raises(RuntimeError, match="asked for 4 blocks, 3 free"):
        pool.get_new_blocks(4)
    assert pool.free_queue.block_ids() == [1, 2, 3]


def test_freed_blocks_join_the_tail_in_the_order_given() -> None:
    pool = make_pool(num_blocks=6)
    b1, b2, b3 = pool.get_new_blocks(3)
    pool.free_blocks([b3, b1])
    assert pool.free_queue.block_ids() == [4, 5, 3, 1]
    assert (b1.ref_cnt, b2.ref_cnt, b3.ref_cnt) == (0, 1, 0)
    # The next allocations follow LRU order: never-used blocks first, then 3, then 1.
    assert ids(pool.get_new_blocks(4)) == [4, 5, 3, 1]


def test_touch_and_free_count_references() -> None:
    pool = make_pool(num_blocks=4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 3
    pool.free_blocks([block])
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert pool.free_queue.block_ids() == [2, 3]
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.free_queue.block_ids() == [2, 3, 1]


def test_freeing_a_free_block_asserts() -> None:
    pool = make_pool(num_blocks=4)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="block 1 freed twice"):
        pool.free_blocks([block])


def test_touching_a_cached_free_block_takes_it_from_the_middle_of_the_queue() -> None:
    pool = make_pool(num_blocks=6)
    blocks = pool.get_new_blocks(5)
    for i, block in enumerate(blocks):
        pool.cache_block(block, make_hash(i))
    pool.free_blocks(blocks)
    assert pool.free_queue.block_ids() == [1, 2, 3, 4, 5]

    hit = pool.get_cached_block(make_hash(2))
    assert hit is blocks[2]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_queue.block_ids() == [1, 2, 4, 5]
    assert pool.get_num_free_blocks() == 4
    # A touched hit keeps its hash: it is in use, not evicted.
    assert pool.get_cached_block(make_hash(2)) is hit

    pool.free_blocks([hit])
    assert pool.free_queue.block_ids() == [1, 2, 4, 5, 3]


def test_touch_of_an_in_use_block_does_not_change_the_queue() -> None:
    pool = make_pool(num_blocks=4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    assert pool.free_queue.block_ids() == [2, 3]


def test_reusing_a_cached_free_block_evicts_its_hash() -> None:
    pool = make_pool(num_blocks=4)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, make_hash(10))
    pool.cache_block(b2, make_hash(20))
    pool.free_blocks([b2, b1])
    assert pool.free_queue.block_ids() == [3, 2, 1]

    # Head first: block 3 (never cached), then block 2, whose prefix is evicted.
    assert ids(pool.get_new_blocks(2)) == [3, 2]
    assert b2.block_hash is None
    assert pool.get_cached_block(make_hash(20)) is None
    assert pool.get_cached_block(make_hash(10)) is b1
    assert set(pool.cached_blocks) == {make_hash(10)}


def test_cache_block_first_writer_wins() -> None:
    pool = make_pool(num_blocks=4)
    b1, b2 = pool.get_new_blocks(2)
    same = make_hash(7, 7)
    pool.cache_block(b1, same)
    pool.cache_block(b2, same)
    assert pool.get_cached_block(same) is b1
    assert b2.block_hash == same

    # Evicting the loser leaves the winner indexed.
    pool.free_blocks([b2])
    assert ids(pool.get_new_blocks(2)) == [3, 2]
    assert b2.block_hash is None
    assert pool.get_cached_block(same) is b1


def test_cache_block_keeps_a_blocks_first_hash() -> None:
    pool = make_pool(num_blocks=3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, make_hash(1))
    pool.cache_block(block, make_hash(2))
    assert block.block_hash == make_hash(1)
    assert pool.get_cached_block(make_hash(1)) is block
    assert pool.get_cached_block(make_hash(2)) is None


def test_cache_block_does_nothing_with_caching_disabled() -> None:
    pool = make_pool(num_blocks=3, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, make_hash(1))
    assert block.block_hash is None
    assert pool.cached_blocks == {}


def test_reset_prefix_cache_refuses_while_a_block_is_in_use() -> None:
    pool = make_pool(num_blocks=4)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, make_hash(1))
    pool.cache_block(b2, make_hash(2))
    pool.free_blocks([b1])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(make_hash(1)) is b1
    assert b1.block_hash == make_hash(1)

    pool.free_blocks([b2])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {}
    assert [b.block_hash for b in pool.blocks] == [None, None, None, None]
    assert pool.free_queue.block_ids() == [3, 1, 2]


def test_usage_counts_allocatable_blocks_only() -> None:
    pool = make_pool(num_blocks=5)
    assert pool.get_usage() == 0.0
    pool.get_new_blocks(1)
    assert pool.get_usage() == 0.25
    pool.get_new_blocks(3)
    assert pool.get_usage() == 1.0
