"""KVCacheManager: slot allocation, prefix-cache hits, freeing order and stats."""

from kvferry.engine.core.kv_cache.manager import KVCacheManager
from kvferry.engine.core.request import Request
from kvferry.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_manager(num_blocks: int = 10, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching)


def make_request(
    req_id: str, num_tokens: int, start: int = 100, cache_salt: bytes | None = None
) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=list(range(start, start + num_tokens)),
        sampling_params=SamplingParams(max_tokens=8),
        arrival_time=0.0,
        cache_salt=cache_salt,
    )


def schedule_prompt(manager: KVCacheManager, request: Request) -> list[int]:
    """Admits a request as the scheduler does (hits first, then the rest of the prompt)
    and indexes its full blocks as the scheduler does once the step has run."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits, num_hit_tokens)
    assert new is not None
    manager.record_prefix_cache_lookup(request.num_tokens, num_hit_tokens)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request, request.num_computed_tokens)
    return manager.get_block_ids(request.request_id)


def free_queue(manager: KVCacheManager) -> list[int]:
    return manager.block_pool.free_queue.block_ids()


def test_allocate_slots_rounds_up_to_whole_blocks() -> None:
    for num_tokens, expected in [(1, [1]), (4, [1]), (5, [1, 2]), (8, [1, 2]), (9, [1, 2, 3])]:
        manager = make_manager()
        request = make_request("a", num_tokens)
        new = manager.allocate_slots(request, num_tokens)
        assert [b.block_id for b in new] == expected, num_tokens
        assert manager.get_block_ids("a") == expected
        assert manager.num_free_blocks == 9 - len(expected)


def test_allocate_slots_adds_a_block_only_when_a_block_boundary_is_crossed() -> None:
    manager = make_manager()
    request = make_request("a", 7)
    assert [b.block_id for b in manager.allocate_slots(request, 7)] == [1, 2]
    request.num_computed_tokens = 7
    request.append_output_token(1)
    # Token 8 still fits block 2.
    assert manager.allocate_slots(request, 1) == []
    request.num_computed_tokens = 8
    request.append_output_token(2)
    # Token 9 opens block 3.
    assert [b.block_id for b in manager.allocate_slots(request, 1)] == [3]
    assert manager.get_block_ids("a") == [1, 2, 3]


def test_allocate_slots_returns_none_and_allocates_nothing_when_too_small() -> None:
    manager = make_manager(num_blocks=4)
    request = make_request("a", 13)
    assert manager.allocate_slots(request, 13) is None
    assert manager.num_free_blocks == 3
    assert free_queue(manager) == [1, 2, 3]
    assert manager.get_block_ids("a") == []
    assert "a" not in manager.req_to_blocks


def test_allocate_slots_failure_keeps_a_running_requests_blocks() -> None:
    manager = make_manager(num_blocks=3)
    request = make_request("a", 8)
    assert [b.block_id for b in manager.allocate_slots(request, 8)] == [1, 2]
    request.num_computed_tokens = 8
    request.append_output_token(1)
    assert manager.allocate_slots(request, 1) is None
    assert manager.get_block_ids("a") == [1, 2]
    assert manager.num_free_blocks == 0


def test_allocation_indexes_nothing_until_the_blocks_are_computed() -> None:
    manager = make_manager()
    request = make_request("a", 10)
    manager.allocate_slots(request, 10)
    pool = manager.block_pool
    assert [b.block_hash for b in pool.blocks[1:4]] == [None, None, None]
    assert pool.cached_blocks == {}
    assert manager.get_computed_blocks(make_request("b", 10)) == ([], 0)
    request.num_computed_tokens = 10
    manager.cache_full_blocks(request, 10)
    assert [b.block_hash for b in pool.blocks[1:3]] == request.block_hashes
    assert len(request.block_hashes) == 2
    assert pool.blocks[3].block_hash is None  # the partial third block
    assert manager.num_cached_blocks["a"] == 2


def test_chunked_prompt_caches_blocks_as_they_fill() -> None:
    manager = make_manager()
    request = make_request("a", 12)
    manager.allocate_slots(request, 6)
    request.num_computed_tokens = 6
    manager.cache_full_blocks(request, 6)
    assert manager.num_cached_blocks["a"] == 1
    assert manager.block_pool.blocks[2].block_hash is None
    manager.allocate_slots(request, 6)
    request.num_computed_tokens = 12
    manager.cache_full_blocks(request, 12)
    assert manager.num_cached_blocks["a"] == 3
    assert [manager.block_pool.blocks[i].block_hash for i in (1, 2, 3)] == request.block_hashes


def test_prefix_hit_of_a_block_aligned_prompt_leaves_the_last_block_to_recompute() -> None:
    # Block size 16: a 32-token prompt hits only its first block.
    manager = KVCacheManager(num_blocks=10, block_size=16, enable_caching=True)
    first = make_request("a", 32)
    assert manager.allocate_slots(first, 32) is not None
    manager.cache_full_blocks(first, 32)
    second = make_request("b", 32)
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert [b.block_id for b in hits] == [1]
    assert num_hit_tokens == 16


def test_prefix_hit_caps_at_num_tokens_minus_one() -> None:
    manager = make_manager()
    schedule_prompt(manager, make_request("a", 12))
    for num_tokens, expected in [(4, []), (5, [1]), (8, [1]), (9, [1, 2]), (12, [1, 2]),
                                 (13, [1, 2, 3])]:
        hits, num_hit_tokens = manager.get_computed_blocks(make_request("q", num_tokens))
        assert [b.block_id for b in hits] == expected, num_tokens
        assert num_hit_tokens == BLOCK_SIZE * len(expected)


def test_prefix_hit_stops_at_the_first_different_block() -> None:
    manager = make_manager()
    schedule_prompt(manager, make_request("a", 12))
    other = make_request("b", 13)
    other.prompt_token_ids[5] = 0
    other.all_token_ids[5] = 0
    hits, num_hit_tokens = manager.get_computed_blocks(other)
    assert [b.block_id for b in hits] == [1]
    assert num_hit_tokens == 4


def test_no_hits_with_caching_disabled() -> None:
    manager = make_manager(enable_caching=False)
    schedule_prompt(manager, make_request("a", 12))
    assert manager.block_pool.cached_blocks == {}
    assert manager.get_computed_blocks(make_request("b", 12)) == ([], 0)
    assert manager.prefix_cache_stats.requests == 0


def test_requests_with_the_same_prompt_share_blocks() -> None:
    manager = make_manager()
    a, b = make_request("a", 10), make_request("b", 10)
    assert schedule_prompt(manager, a) == [1, 2, 3]
    assert schedule_prompt(manager, b) == [1, 2, 4]
    pool = manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert manager.num_free_blocks == 5

    manager.free(a)
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    assert free_queue(manager) == [5, 6, 7, 8, 9, 3]
    manager.free(b)
    assert free_queue(manager) == [5, 6, 7, 8, 9, 3, 4, 2, 1]
    assert manager.num_free_blocks == 9


def test_cache_salt_separates_equal_prompts() -> None:
    manager = make_manager()
    schedule_prompt(manager, make_request("a", 9, cache_salt=b"tenant-1"))
    assert manager.get_computed_blocks(make_request("b", 9))[1] == 0
    assert manager.get_computed_blocks(make_request("c", 9, cache_salt=b"tenant-2"))[1] == 0
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("d", 9, cache_salt=b"tenant-1"))
    assert [b.block_id for b in hits] == [1, 2]
    assert num_hit_tokens == 8


def test_free_releases_tail_first() -> None:
    manager = make_manager(num_blocks=6)
    request = make_request("a", 13)
    schedule_prompt(manager, request)
    assert manager.get_block_ids("a") == [1, 2, 3, 4]
    manager.free(request)
    assert free_queue(manager) == [5, 4, 3, 2, 1]
    assert manager.get_block_ids("a") == []
    assert "a" not in manager.num_cached_blocks


def test_freed_prefix_is_reused_and_the_tail_is_evicted_first() -> None:
    manager = make_manager(num_blocks=5)
    a = make_request("a", 12)
    schedule_prompt(manager, a)  # blocks 1, 2, 3 all full and cached
    manager.free(a)
    assert free_queue(manager) == [4, 3, 2, 1]

    # An unrelated 8-token request takes blocks 4 and 3: block 3's prefix is evicted.
    c = make_request("c", 8, start=500)
    assert schedule_prompt(manager, c) == [4, 3]
    pool = manager.block_pool
    assert pool.get_cached_block(a.block_hashes[2]) is None
    assert pool.get_cached_block(a.block_hashes[1]) is pool.blocks[2]
    assert free_queue(manager) == [2, 1]

    # The first two blocks of a's prompt are still hits.
    b = make_request("b", 12)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2]
    assert num_hit_tokens == 8


def test_free_cached_hits_count_against_free_space() -> None:
    manager = make_manager(num_blocks=4)
    a = make_request("a", 8)
    schedule_prompt(manager, a)
    manager.free(a)
    holder = make_request("holder", 1, start=900)
    assert [b.block_id for b in manager.allocate_slots(holder, 1)] == [3]
    assert free_queue(manager) == [2, 1]

    # b hits blocks 1 and 2 (both free) and needs one more: three blocks from two free.
    b = make_request("b", 12)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2]
    assert manager.allocate_slots(b, 4, hits, num_hit_tokens) is None
    # Nothing was touched or evicted.
    assert free_queue(manager) == [2, 1]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2)] == [0, 0]
    assert manager.block_pool.get_cached_block(b.block_hashes[0]) is manager.block_pool.blocks[1]
    assert "b" not in manager.req_to_blocks

    manager.free(holder)
    new = manager.allocate_slots(b, 4, hits, num_hit_tokens)
    assert [blk.block_id for blk in new] == [3]
    assert manager.get_block_ids("b") == [1, 2, 3]
    assert manager.num_free_blocks == 0


def test_hits_on_in_use_blocks_do_not_count_against_free_space() -> None:
    manager = make_manager(num_blocks=4)
    schedule_prompt(manager, make_request("a", 8))
    b = make_request("b", 9)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2]
    new = manager.allocate_slots(b, 1, hits, num_hit_tokens)
    assert [blk.block_id for blk in new] == [3]
    assert manager.get_block_ids("b") == [1, 2, 3]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 1]


def test_prefix_cache_stats_count_queried_and_hit_tokens() -> None:
    manager = make_manager()
    schedule_prompt(manager, make_request("a", 10))
    # A lookup whose request is not admitted (it stays waiting) is not counted.
    manager.get_computed_blocks(make_request("b", 10))
    assert manager.prefix_cache_stats.requests == 1
    schedule_prompt(manager, make_request("b", 10))
    schedule_prompt(manager, make_request("c", 6, start=700))
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (3, 26, 8)


def test_usage_and_reset_prefix_cache() -> None:
    manager = make_manager(num_blocks=5)
    a = make_request("a", 8)
    schedule_prompt(manager, a)
    assert manager.usage == 0.5
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.usage == 0.0
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", 9)) == ([], 0)


def test_allocate_running_slots_grows_each_table() -> None:
    manager = make_manager()
    a, b = make_request("a", 4), make_request("b", 6, start=200)
    schedule_prompt(manager, a)
    schedule_prompt(manager, b)
    assert (manager.get_block_ids("a"), manager.get_block_ids("b")) == ([1], [2, 3])
    assert manager.num_slots(["a", "b", "unknown"]).tolist() == [4, 8, 0]
    # a's fifth token opens a block; b jumps to 13 tokens, two more blocks.
    assert manager.allocate_running_slots([a, b], [5, 13]) == [[4], [5, 6]]
    assert (manager.get_block_ids("a"), manager.get_block_ids("b")) == ([1, 4], [2, 3, 5, 6])
    assert manager.num_free_blocks == 3


def test_allocate_running_slots_is_all_or_nothing() -> None:
    manager = make_manager(num_blocks=5)
    a, b = make_request("a", 4), make_request("b", 4, start=200)
    schedule_prompt(manager, a)
    schedule_prompt(manager, b)
    # Two free blocks, three wanted: nobody gets any.
    assert manager.allocate_running_slots([a, b], [5, 9]) is None
    assert (manager.get_block_ids("a"), manager.get_block_ids("b")) == ([1], [2])
    assert manager.num_free_blocks == 2
    assert manager.allocate_running_slots([a, b], [5, 5]) == [[3], [4]]
    assert manager.num_free_blocks == 0
