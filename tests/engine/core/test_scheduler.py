"""Scheduler: per-step plans, chunked prefill, preemption, aborts and stop conditions.

Every scenario drives a real KVCacheManager with block size 4 and no model: the test plays
the runner, sampling fixed token ids for the requests whose prompt is done.
"""

import pytest
from kvferry.engine.config import SchedulerConfig
from kvferry.engine.core.kv_cache import KVCacheManager
from kvferry.engine.core.messages import EngineCoreOutput, FinishReason
from kvferry.engine.core.request import Request, RequestStatus
from kvferry.engine.core.scheduler import Scheduler
from kvferry.engine.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    SchedulerOutput,
)
from kvferry.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
EOS = 2
FILLER = 7  # a token id that stops nothing


def make_scheduler(
    num_blocks: int = 16, enable_caching: bool = False, **config: object
) -> Scheduler:
    config.setdefault("max_model_len", 64)
    config.setdefault("max_num_batched_tokens", 64)
    manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching)
    return Scheduler(SchedulerConfig(**config), manager)  # type: ignore[arg-type]


def prompt(num_tokens: int, start: int) -> list[int]:
    return list(range(start, start + num_tokens))


def make_request(
    req_id: str,
    num_prompt_tokens: int,
    start: int = 100,
    priority: int = 0,
    arrival_time: float = 0.0,
    **params: object,
) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=prompt(num_prompt_tokens, start),
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_ids=(EOS,),
        priority=priority,
        arrival_time=arrival_time,
    )


def new_reqs(output: SchedulerOutput) -> list[tuple[str, list[int], list[int], int]]:
    """(req_id, token_ids, block_ids, num_computed_tokens) of each new request."""
    return [
        (r.req_id, r.token_ids, r.block_ids, r.num_computed_tokens)
        for r in output.scheduled_new_reqs
    ]


def cached_reqs(output: SchedulerOutput) -> list[tuple[str, list[int], int]]:
    """(req_id, new_block_ids, num_computed_tokens) of each request the runner holds."""
    cached = output.scheduled_cached_reqs
    new_block_ids = [cached.new_block_ids.get(r, []) for r in cached.req_ids]
    return list(zip(cached.req_ids, new_block_ids, cached.num_computed_tokens))


def sample(
    scheduler: Scheduler, output: SchedulerOutput, tokens: dict[str, int]
) -> list[EngineCoreOutput]:
    """Plays the runner: `tokens` holds the token sampled by each request that samples."""
    runner_output = ModelRunnerOutput(req_ids=list(tokens), sampled_token_ids=list(tokens.values()))
    return scheduler.update_from_output(output, runner_output)


def sampling_req_ids(scheduler: Scheduler, output: SchedulerOutput) -> list[str]:
    """Requests whose prompt is done after this step's tokens (partial chunks sample nothing)."""
    return [
        req_id
        for req_id in output.num_scheduled_tokens
        if scheduler.requests[req_id].num_computed_tokens >= scheduler.requests[req_id].num_tokens
    ]


def drain(scheduler: Scheduler, max_steps: int = 200) -> None:
    """Runs steps, sampling FILLER for everyone, until no request is left.

    Requests still waiting for the sample of the test's last step get it first.
    """
    pending = [r.request_id for r in scheduler.running if r.num_computed_tokens == r.num_tokens]
    sample(scheduler, SchedulerOutput([], CachedRequestData(), {}, 0, set(), set()),
           {r: FILLER for r in pending})
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        output = scheduler.schedule()
        sample(scheduler, output, {r: FILLER for r in sampling_req_ids(scheduler, output)})
    raise AssertionError(f"requests left after {max_steps} steps: {list(scheduler.requests)}")


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.block_pool.num_blocks - 1
    assert manager.req_to_blocks == {}
    assert scheduler.running == []
    assert len(scheduler.waiting) == 0


# ---------------------------------------------------------------------- step plans
def test_first_step_sends_new_requests_with_whole_block_tables() -> None:
    scheduler = make_scheduler()
    a, b = make_request("a", 6, start=100), make_request("b", 9, start=200)
    scheduler.add_request(a)
    scheduler.add_request(b)

    out = scheduler.schedule()
    assert new_reqs(out) == [
        ("a", prompt(6, 100), [1, 2], 0),
        ("b", prompt(9, 200), [3, 4, 5], 0),
    ]
    assert [r.num_prompt_tokens for r in out.scheduled_new_reqs] == [6, 9]
    assert out.scheduled_new_reqs[0].sampling_params is a.sampling_params
    assert cached_reqs(out) == []
    assert out.num_scheduled_tokens == {"a": 6, "b": 9}
    assert out.total_num_scheduled_tokens == 15
    assert out.finished_req_ids == set()
    assert out.preempted_req_ids == set()
    assert out.blocked_stop_token_ids == {}
    assert (a.num_computed_tokens, b.num_computed_tokens) == (6, 9)
    assert (a.status, b.status) == (RequestStatus.RUNNING, RequestStatus.RUNNING)
    assert scheduler.running == [a, b]
    assert scheduler.kv_cache_manager.num_free_blocks == 10

    drain(scheduler)
    assert_all_blocks_free(scheduler)


def test_decode_steps_send_only_appended_block_ids() -> None:
    scheduler = make_scheduler()
    a, b = make_request("a", 6, start=100), make_request("b", 9, start=200)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    updates = sample(scheduler, out, {"a": 50, "b": 60})
    assert [(o.req_id, o.new_token_ids) for o in updates] == [("a", [50]), ("b", [60])]
    assert a.all_token_ids == prompt(6, 100) + [50]

    out = scheduler.schedule()
    assert new_reqs(out) == []
    assert cached_reqs(out) == [("a", [], 6), ("b", [], 9)]
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.total_num_scheduled_tokens == 2
    sample(scheduler, out, {"a": 51, "b": 61})

    out = scheduler.schedule()
    assert cached_reqs(out) == [("a", [], 7), ("b", [], 10)]
    sample(scheduler, out, {"a": 52, "b": 62})

    # a's 9th token opens a new block; b's 12th still fits its third.
    out = scheduler.schedule()
    assert cached_reqs(out) == [("a", [6], 8), ("b", [], 11)]
    assert scheduler.kv_cache_manager.get_block_ids("a") == [1, 2, 6]
    sample(scheduler, out, {"a": 53, "b": 63})

    out = scheduler.schedule()
    assert cached_reqs(out) == [("a", [], 9), ("b", [7], 12)]
    assert a.output_token_ids == [50, 51, 52, 53]

    drain(scheduler)
    assert_all_blocks_free(scheduler)


def test_an_empty_step_when_nothing_is_waiting() -> None:
    scheduler = make_scheduler()
    out = scheduler.schedule()
    assert out.is_empty
    assert out.num_scheduled_tokens == {}
    assert new_reqs(out) == [] and cached_reqs(out) == []


def test_a_request_waiting_for_its_sample_is_not_rescheduled() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5))
    scheduler.schedule()
    # No update_from_output yet: every known token already has KV.
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {}
    assert cached_reqs(out) == []


# ---------------------------------------------------------------------- chunked prefill
def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", 20)
    scheduler.add_request(a)

    out = scheduler.schedule()
    assert new_reqs(out) == [("a", prompt(20, 100), [1, 2], 0)]
    assert out.num_scheduled_tokens == {"a": 8}
    assert sampling_req_ids(scheduler, out) == []
    sample(scheduler, out, {})

    out = scheduler.schedule()
    assert cached_reqs(out) == [("a", [3, 4], 8)]
    assert out.num_scheduled_tokens == {"a": 8}
    sample(scheduler, out, {})

    out = scheduler.schedule()
    assert cached_reqs(out) == [("a", [5], 16)]
    assert out.num_scheduled_tokens == {"a": 4}
    assert sampling_req_ids(scheduler, out) == ["a"]
    sample(scheduler, out, {"a": 40})

    out = scheduler.schedule()
    assert cached_reqs(out) == [("a", [6], 20)]
    assert out.num_scheduled_tokens == {"a": 1}

    drain(scheduler)
    assert_all_blocks_free(scheduler)


def test_chunked_prefill_fills_what_is_left_of_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(make_request("a", 10, start=100))
    scheduler.add_request(make_request("b", 10, start=200))

    out = scheduler.schedule()
    assert new_reqs(out) == [
        ("a", prompt(10, 100), [1, 2, 3], 0),
        ("b", prompt(10, 200), [4, 5], 0),
    ]
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}
    assert out.total_num_scheduled_tokens == 16
    sample(scheduler, out, {"a": 50})

    out = scheduler.schedule()
    assert cached_reqs(out) == [("a", [], 10), ("b", [6], 6)]
    assert out.num_scheduled_tokens == {"a": 1, "b": 4}

    drain(scheduler)
    assert_all_blocks_free(scheduler)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a, b = make_request("a", 10, start=100), make_request("b", 10, start=200)
    scheduler.add_request(a)
    scheduler.add_request(b)

    out = scheduler.schedule()
    assert new_reqs(out) == [("a", prompt(10, 100), [1, 2, 3], 0)]
    assert out.num_scheduled_tokens == {"a": 10}
    assert b.status == RequestStatus.WAITING
    assert b.num_computed_tokens == 0
    assert scheduler.kv_cache_manager.get_block_ids("b") == []
    sample(scheduler, out, {"a": 50})

    out = scheduler.schedule()
    assert cached_reqs(out) == [("a", [], 10)]
    assert new_reqs(out) == [("b", prompt(10, 200), [4, 5, 6], 0)]
    assert out.num_scheduled_tokens == {"a": 1, "b": 10}

    drain(scheduler)
    assert_all_blocks_free(scheduler)


# ---------------------------------------------------------------------- admission
def test_max_num_seqs_caps_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i, req_id in enumerate("abc"):
        scheduler.add_request(make_request(req_id, 4, start=100 * (i + 1), max_tokens=1))

    out = scheduler.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    sample(scheduler, out, {"a": FILLER})  # a is done (max_tokens=1); b's sample is late

    out = scheduler.schedule()
    assert out.finished_req_ids == {"a"}
    assert cached_reqs(out) == []
    # a's block went to the tail of the free queue: c takes the next never-used one.
    assert new_reqs(out) == [("c", prompt(4, 300), [3], 0)]
    assert out.num_scheduled_tokens == {"c": 4}

    drain(scheduler)
    assert_all_blocks_free(scheduler)


def test_fcfs_admits_in_arrival_order_without_skipping_the_head() -> None:
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("a", 7, start=100, max_tokens=2))
    out = scheduler.schedule()
    assert new_reqs(out) == [("a", prompt(7, 100), [1, 2], 0)]
    sample(scheduler, out, {"a": FILLER})

    # b needs two blocks and one is free; c would fit but must not overtake b,
    # whatever its priority value (FCFS ignores it).
    scheduler.add_request(make_request("b", 8, start=200, max_tokens=1))
    scheduler.add_request(make_request("c", 4, start=300, priority=-5, max_tokens=1))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 1}
    assert new_reqs(out) == []
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    sample(scheduler, out, {"a": FILLER})

    out = scheduler.schedule()
    assert out.finished_req_ids == {"a"}
    assert new_reqs(out) == [("b", prompt(8, 200), [3, 2], 0), ("c", prompt(4, 300), [1], 0)]

    drain(scheduler)
    assert_all_blocks_free(scheduler)


def test_priority_policy_admits_lower_value_first_then_arrival() -> None:
    scheduler = make_scheduler(max_num_seqs=2, policy="priority")
    scheduler.add_request(make_request("p2", 4, start=100, priority=2, arrival_time=0.0,
                                       max_tokens=1))
    scheduler.add_request(make_request("p0-late", 4, start=200, priority=0, arrival_time=3.0,
                                       max_tokens=1))
    scheduler.add_request(make_request("p1", 4, start=300, priority=1, arrival_time=1.0,
                                       max_tokens=1))
    scheduler.add_request(make_request("p0-early", 4, start=400, priority=0, arrival_time=2.0,
                                       max_tokens=1))

    out = scheduler.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["p0-early", "p0-late"]
    sample(scheduler, out, {"p0-early": FILLER, "p0-late": FILLER})

    out = scheduler.schedule()
    assert out.finished_req_ids == {"p0-early", "p0-late"}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["p1", "p2"]

    drain(scheduler)
    assert_all_blocks_free(scheduler)


# ---------------------------------------------------------------------- preemption
def test_fcfs_preempts_the_last_running_request_and_requeues_it_first() -> None:
    scheduler = make_scheduler(num_blocks=5, max_num_seqs=2)
    a = make_request("a", 7, start=100, max_tokens=3)
    b = make_request("b", 7, start=200, max_tokens=3)
    c = make_request("c", 4, start=300, max_tokens=1)
    for request in (a, b, c):
        scheduler.add_request(request)

    out = scheduler.schedule()
    assert new_reqs(out) == [("a", prompt(7, 100), [1, 2], 0), ("b", prompt(7, 200), [3, 4], 0)]
    sample(scheduler, out, {"a": 10, "b": 20})
    out = scheduler.schedule()
    assert cached_reqs(out) == [("a", [], 7), ("b", [], 7)]
    sample(scheduler, out, {"a": 11, "b": 21})

    # a's 9th token needs a block and none is free: b (last running) is preempted.
    out = scheduler.schedule()
    assert out.preempted_req_ids == {"b"}
    assert cached_reqs(out) == [("a", [4], 8)]
    assert new_reqs(out) == []
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.total_num_scheduled_tokens == 1
    assert out.finished_req_ids == set()
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert scheduler.running == [a]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.kv_cache_manager.get_block_ids("b") == []
    assert scheduler.kv_cache_manager.block_pool.free_queue.block_ids() == [3]
    sample(scheduler, out, {"a": 12})
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED

    # b comes back as a new request carrying its outputs; it is recomputed from scratch.
    out = scheduler.schedule()
    assert out.finished_req_ids == {"a"}
    assert out.preempted_req_ids == set()
    assert new_reqs(out) == [
        ("b", prompt(7, 200) + [20, 21], [3, 4, 2], 0),
        ("c", prompt(4, 300), [1], 0),
    ]
    assert out.scheduled_new_reqs[0].num_prompt_tokens == 7
    assert out.num_scheduled_tokens == {"b": 9, "c": 4}
    sample(scheduler, out, {"b": 22, "c": FILLER})
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert b.output_token_ids == [20, 21, 22]

    drain(scheduler)
    assert_all_blocks_free(scheduler)


def test_a_running_request_that_cannot_grow_preempts_itself() -> None:
    scheduler = make_scheduler(num_blocks=4)
    a = make_request("a", 2, start=100, max_tokens=2)
    b = make_request("b", 8, start=200, max_tokens=2)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert new_reqs(out) == [("a", prompt(2, 100), [1], 0), ("b", prompt(8, 200), [2, 3], 0)]
    sample(scheduler, out, {"a": 10, "b": 20})

    out = scheduler.schedule()
    assert out.preempted_req_ids == {"b"}
    assert cached_reqs(out) == [("a", [], 2)]
    assert out.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    sample(scheduler, out, {"a": 11})
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED

    out = scheduler.schedule()
    assert out.finished_req_ids == {"a"}
    assert new_reqs(out) == [("b", prompt(8, 200) + [20], [3, 2, 1], 0)]
    sample(scheduler, out, {"b": 21})
    assert b.output_token_ids == [20, 21]

    drain(scheduler)
    assert_all_blocks_free(scheduler)


@pytest.mark.parametrize("enable_caching", [False, True])
def test_priority_preemption_picks_the_lowest_priority_even_if_already_scheduled(
    enable_caching: bool,
) -> None:
    scheduler = make_scheduler(num_blocks=6, policy="priority", enable_caching=enable_caching)
    low = make_request("low", 4, start=100, priority=5, arrival_time=0.0, max_tokens=4)
    scheduler.add_request(low)
    out = scheduler.schedule()
    assert new_reqs(out) == [("low", prompt(4, 100), [1], 0)]
    sample(scheduler, out, {"low": 10})

    high = make_request("high", 8, start=200, priority=0, arrival_time=1.0, max_tokens=4)
    mid = make_request("mid", 3, start=300, priority=1, arrival_time=2.0, max_tokens=2)
    scheduler.add_request(mid)
    scheduler.add_request(high)
    out = scheduler.schedule()
    assert cached_reqs(out) == [("low", [2], 4)]
    assert new_reqs(out) == [("high", prompt(8, 200), [3, 4], 0), ("mid", prompt(3, 300), [5], 0)]
    assert scheduler.running == [low, high, mid]
    sample(scheduler, out, {"low": 11, "high": 20, "mid": 30})

    # high's 9th token needs a block: low is the victim though it was scheduled first.
    out = scheduler.schedule()
    assert out.preempted_req_ids == {"low"}
    assert cached_reqs(out) == [("high", [2], 8), ("mid", [], 3)]
    assert out.num_scheduled_tokens == {"high": 1, "mid": 1}
    assert out.total_num_scheduled_tokens == 2
    assert low.status == RequestStatus.PREEMPTED
    assert low.num_computed_tokens == 0
    assert scheduler.running == [high, mid]
    assert scheduler.kv_cache_manager.get_block_ids("low") == []
    assert scheduler.kv_cache_manager.block_pool.free_queue.block_ids() == [1]
    assert (high.num_computed_tokens, mid.num_computed_tokens) == (9, 4)
    sample(scheduler, out, {"high": 21, "mid": 31})
    assert mid.status == RequestStatus.FINISHED_LENGTH_CAPPED

    # low comes back with its outputs. Its first block (the prompt, computed in step 1) is
    # still free and, with caching on, still indexed: only the last 2 tokens are computed.
    out = scheduler.schedule()
    assert out.finished_req_ids == {"mid"}
    num_hit = 4 if enable_caching else 0
    assert new_reqs(out) == [("low", prompt(4, 100) + [10, 11], [1, 5], num_hit)]
    assert out.num_scheduled_tokens == {"high": 1, "low": 6 - num_hit}
    sample(scheduler, out, {"high": 22, "low": 12})

    drain(scheduler)
    assert low.output_token_ids == [10, 11, 12, FILLER]
    assert low.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert high.output_token_ids == [20, 21, 22, FILLER]
    assert_all_blocks_free(scheduler)


def test_fcfs_would_preempt_the_last_running_request_in_the_same_scenario() -> None:
    scheduler = make_scheduler(num_blocks=6, policy="fcfs")
    low = make_request("low", 4, start=100, priority=5, max_tokens=4)
    scheduler.add_request(low)
    sample(scheduler, scheduler.schedule(), {"low": 10})
    high = make_request("high", 8, start=200, priority=0, max_tokens=4)
    mid = make_request("mid", 3, start=300, priority=1, max_tokens=4)
    scheduler.add_request(high)
    scheduler.add_request(mid)
    out = scheduler.schedule()
    assert scheduler.running == [low, high, mid]
    sample(scheduler, out, {"low": 11, "high": 20, "mid": 30})

    out = scheduler.schedule()
    assert out.preempted_req_ids == {"mid"}
    assert cached_reqs(out) == [("low", [], 5), ("high", [5], 8)]

    drain(scheduler)
    assert_all_blocks_free(scheduler)


# ---------------------------------------------------------------------- prefix caching
def test_a_repeated_prompt_starts_from_its_prefix_hit() -> None:
    scheduler = make_scheduler(enable_caching=True)
    a = make_request("a", 10, start=100)
    scheduler.add_request(a)
    sample(scheduler, scheduler.schedule(), {"a": 50})

    b = make_request("b", 10, start=100)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert new_reqs(out) == [("b", prompt(10, 100), [1, 2, 4], 8)]
    assert out.num_scheduled_tokens == {"a": 1, "b": 2}
    assert b.num_cached_tokens == 8
    assert b.num_computed_tokens == 10
    pool = scheduler.kv_cache_manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert scheduler.kv_cache_manager.prefix_cache_stats.hits == 8

    drain(scheduler)
    assert_all_blocks_free(scheduler)


def test_a_preempted_request_resumes_from_what_is_left_of_its_cached_prefix() -> None:
    scheduler = make_scheduler(num_blocks=5, max_num_seqs=2, enable_caching=True)
    a = make_request("a", 7, start=100, max_tokens=3)
    b = make_request("b", 7, start=200, max_tokens=3)
    c = make_request("c", 4, start=300, max_tokens=1)
    for request in (a, b, c):
        scheduler.add_request(request)
    sample(scheduler, scheduler.schedule(), {"a": 10, "b": 20})
    sample(scheduler, scheduler.schedule(), {"a": 11, "b": 21})

    out = scheduler.schedule()
    assert out.preempted_req_ids == {"b"}
    assert cached_reqs(out) == [("a", [4], 8)]
    # a reused b's second block, evicting its prefix; b's first block is still cached.
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_cached_block(b.block_hashes[0]) is pool.blocks[3]
    assert pool.get_cached_block(b.block_hashes[1]) is None
    sample(scheduler, out, {"a": 12})

    out = scheduler.schedule()
    assert new_reqs(out) == [
        ("b", prompt(7, 200) + [20, 21], [3, 4, 2], 4),
        ("c", prompt(4, 300), [1], 0),
    ]
    assert out.num_scheduled_tokens == {"b": 5, "c": 4}
    assert b.num_cached_tokens == 0  # set once, when b was first scheduled

    drain(scheduler)
    assert_all_blocks_free(scheduler)


# ---------------------------------------------------------------------- aborts
def test_abort_of_a_running_request_frees_blocks_and_is_reported_once() -> None:
    scheduler = make_scheduler()
    a, b = make_request("a", 6, start=100), make_request("b", 5, start=200)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    sample(scheduler, out, {"a": 50, "b": 60})

    finished = scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert finished == [a]
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert a.status.finish_reason == FinishReason.ABORT
    assert scheduler.kv_cache_manager.get_block_ids("a") == []
    assert scheduler.kv_cache_manager.num_free_blocks == 13
    assert scheduler.running == [b]
    assert "a" not in scheduler.requests

    out = scheduler.schedule()
    assert out.finished_req_ids == {"a"}
    assert cached_reqs(out) == [("b", [], 5)]
    assert out.num_scheduled_tokens == {"b": 1}
    # A token sampled for a request aborted mid-step is dropped.
    updates = sample(scheduler, out, {"a": 51, "b": 61})
    assert [(o.req_id, o.new_token_ids) for o in updates] == [("b", [61])]
    assert a.output_token_ids == [50]

    out = scheduler.schedule()
    assert out.finished_req_ids == set()

    drain(scheduler)
    assert_all_blocks_free(scheduler)


def test_abort_of_a_waiting_request_is_reported_once() -> None:
    # The runner drops whatever it keeps for a finished id and ignores ids it never saw.
    scheduler = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 4, start=100), make_request("b", 4, start=200)
    scheduler.add_request(a)
    scheduler.add_request(b)
    scheduler.schedule()
    assert scheduler.finish_requests(["b", "nope"], RequestStatus.FINISHED_ABORTED) == [b]
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert len(scheduler.waiting) == 0
    assert scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED) == []

    out = scheduler.schedule()
    assert out.finished_req_ids == {"b"}
    assert scheduler.schedule().finished_req_ids == set()
    assert scheduler.get_num_unfinished_requests() == 1

    drain(scheduler)
    assert_all_blocks_free(scheduler)


def test_abort_of_a_preempted_request_is_reported_to_the_runner() -> None:
    # The runner dropped b's row at preemption but keeps its seeded generator for when it
    # resumes; only a finished id tells it to let go.
    scheduler = make_scheduler(num_blocks=4)
    a = make_request("a", 2, start=100, max_tokens=2)
    b = make_request("b", 8, start=200, max_tokens=2)
    scheduler.add_request(a)
    scheduler.add_request(b)
    sample(scheduler, scheduler.schedule(), {"a": 10, "b": 20})
    out = scheduler.schedule()
    assert out.preempted_req_ids == {"b"}

    assert scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED) == [b]
    assert len(scheduler.waiting) == 0
    out = scheduler.schedule()
    assert out.finished_req_ids == {"b"}

    drain(scheduler)
    assert_all_blocks_free(scheduler)


def test_abort_of_a_request_admitted_this_step_is_reported() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 6))
    scheduler.schedule()
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.schedule().finished_req_ids == {"a"}
    assert_all_blocks_free(scheduler)


# ---------------------------------------------------------------------- stop conditions
def run_one(
    tokens: list[int], num_prompt_tokens: int = 6, max_model_len: int = 64, **params: object
) -> tuple[Scheduler, Request, list[SchedulerOutput]]:
    """Runs one request, sampling `tokens` in order until it finishes or they run out."""
    scheduler = make_scheduler(max_model_len=max_model_len)
    request = make_request("r", num_prompt_tokens, **params)
    scheduler.add_request(request)
    outputs = []
    for token in tokens:
        out = scheduler.schedule()
        outputs.append(out)
        sample(scheduler, out, {"r": token})
        if request.is_finished:
            break
    return scheduler, request, outputs


def test_eos_stops_the_request() -> None:
    scheduler, request, _ = run_one([5, EOS, 6])
    assert request.output_token_ids == [5, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.status.finish_reason == FinishReason.STOP
    assert request.stop_reason is None
    assert scheduler.schedule().finished_req_ids == {"r"}
    assert_all_blocks_free(scheduler)


def test_ignore_eos_keeps_generating_past_eos() -> None:
    scheduler, request, _ = run_one([EOS, EOS, 5], ignore_eos=True, max_tokens=3)
    assert request.output_token_ids == [EOS, EOS, 5]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_blocks_free(scheduler)


def test_stop_token_ids_stop_and_set_the_stop_reason() -> None:
    scheduler, request, _ = run_one([5, 9, 6], stop_token_ids=[8, 9])
    assert request.output_token_ids == [5, 9]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 9
    assert_all_blocks_free(scheduler)


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    _, request, _ = run_one([EOS, 9], stop_token_ids=[9], ignore_eos=True)
    assert request.output_token_ids == [EOS, 9]
    assert request.stop_reason == 9
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_max_tokens_caps_the_length() -> None:
    scheduler, request, _ = run_one([5, 6, 7, 8], max_tokens=3)
    assert request.output_token_ids == [5, 6, 7]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.status.finish_reason == FinishReason.LENGTH
    assert_all_blocks_free(scheduler)


def test_max_model_len_caps_the_length() -> None:
    scheduler, request, outputs = run_one([5, 6, 7], max_model_len=8, max_tokens=None)
    assert request.output_token_ids == [5, 6]
    assert request.num_tokens == 8
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert [o.num_scheduled_tokens for o in outputs] == [{"r": 6}, {"r": 1}]
    assert_all_blocks_free(scheduler)


def test_eos_before_min_tokens_does_not_stop_and_is_blocked() -> None:
    scheduler, request, outputs = run_one(
        [EOS, 9, 5, EOS], min_tokens=3, stop_token_ids=[9]
    )
    assert request.output_token_ids == [EOS, 9, 5, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason is None
    assert [o.blocked_stop_token_ids for o in outputs] == [
        {"r": [EOS, 9]},
        {"r": [EOS, 9]},
        {"r": [EOS, 9]},
        {},
    ]
    assert_all_blocks_free(scheduler)


def test_min_tokens_with_ignore_eos_blocks_only_stop_token_ids() -> None:
    _, request, outputs = run_one([EOS, 9], min_tokens=1, stop_token_ids=[9], ignore_eos=True)
    assert [o.blocked_stop_token_ids for o in outputs] == [{"r": [9]}, {}]
    assert request.stop_reason == 9


def test_min_tokens_does_not_run_past_max_model_len() -> None:
    # 6 prompt tokens and max_model_len 8 leave room for 2 outputs, fewer than min_tokens.
    scheduler, request, _ = run_one([5, 6, 7, 8], max_model_len=8, min_tokens=5, max_tokens=10)
    assert request.output_token_ids == [5, 6]
    assert request.num_tokens == 8
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_blocks_free(scheduler)


def test_partial_prefill_chunks_are_not_sampled_or_stopped() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request("r", 6, max_tokens=1)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert sampling_req_ids(scheduler, out) == []
    assert sample(scheduler, out, {}) == []
    assert request.status == RequestStatus.RUNNING
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 2}
    updates = sample(scheduler, out, {"r": 5})
    assert [(o.req_id, o.new_token_ids) for o in updates] == [("r", [5])]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_blocks_free(scheduler)


def test_make_stats_reports_running_waiting_and_usage() -> None:
    scheduler = make_scheduler(num_blocks=5, max_num_seqs=1)
    scheduler.add_request(make_request("a", 8, start=100))
    scheduler.add_request(make_request("b", 4, start=200))
    scheduler.schedule()
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (1, 1, 0.5)


def test_a_request_that_preempts_itself_does_not_stop_those_after_it() -> None:
    # Two usable blocks of 4. `low` needs a third block and is the priority policy's victim;
    # `high`, after it in running order, still fits its own block and must run this step.
    scheduler = make_scheduler(num_blocks=3, max_model_len=8, policy="priority")
    low = make_request("low", 3, start=100, priority=1, arrival_time=0.0)
    scheduler.add_request(low)
    sample(scheduler, scheduler.schedule(), {"low": 10})
    scheduler.add_request(make_request("high", 3, start=200, priority=0, arrival_time=1.0))
    out = scheduler.schedule()
    sample(scheduler, out, {"low": 11, "high": 20})
    assert [r.request_id for r in scheduler.running] == ["low", "high"]

    out = scheduler.schedule()
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 1}
    assert cached_reqs(out) == [("high", [], 3)]
    drain(scheduler)
    assert_all_blocks_free(scheduler)
