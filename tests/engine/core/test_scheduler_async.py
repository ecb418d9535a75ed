"""Scheduler with async scheduling: step N+1 is scheduled before step N is updated.

Every scenario drives a real KVCacheManager with block size 4 and no model: the test plays
the device, choosing each step's sampled tokens, and updates a step only after the next one
was scheduled, as the engine core does. (test_scheduler_random.py runs random workloads the
same way against the synchronous loop.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from kvferry.engine.config import SchedulerConfig
from kvferry.engine.core.kv_cache import KVCacheManager
from kvferry.engine.core.messages import EngineCoreOutput, FinishReason
from kvferry.engine.core.request import Request, RequestStatus
from kvferry.engine.core.scheduler import Scheduler
from kvferry.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvferry.engine.sampling_params import SamplingParams
from kvferry.kvtransfer import (
    KVConnectorOutput,
    KVConnectorScheduler,
    KVTransferConfig,
    KVTransferMetrics,
    KVTransferParams,
    ProducerEndpoint,
)
from kvferry.kvtransfer.auth import sign_params
from kvferry.kvtransfer.lease import LeaseTable
from kvferry_testing.keys import TEST_KEY

BLOCK_SIZE = 4
EOS = 2
STOP = 9


def make_scheduler(num_blocks: int = 32, enable_caching: bool = False,
                   connector: KVConnectorScheduler | None = None, **config: object) -> Scheduler:
    config.setdefault("max_model_len", 64)
    config.setdefault("max_num_batched_tokens", 64)
    manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching)
    return Scheduler(SchedulerConfig(async_scheduling=True, **config), manager,  # type: ignore[arg-type]
                     connector)


def make_request(req_id: str, num_prompt_tokens: int, start: int = 100,
                 **params: object) -> Request:
    return Request(
        request_id=req_id, prompt_token_ids=list(range(start, start + num_prompt_tokens)),
        sampling_params=SamplingParams(**params), eos_token_ids=(EOS,),  # type: ignore[arg-type]
    )


def update(scheduler: Scheduler, output: SchedulerOutput,
           tokens: dict[str, int]) -> dict[str, EngineCoreOutput]:
    """Plays the device's answer for a step: `tokens` holds what each sampled row drew."""
    runner_output = ModelRunnerOutput(req_ids=list(tokens), sampled_token_ids=list(tokens.values()))
    return {o.req_id: o for o in scheduler.update_from_output(output, runner_output)}


def schedule(scheduler: Scheduler) -> tuple[SchedulerOutput, list[str]]:
    """Schedules a step; returns it and the requests it samples (those it gave a
    placeholder)."""
    before = {r: q.num_output_placeholders for r, q in scheduler.requests.items()}
    output = scheduler.schedule()
    requests = scheduler.requests
    return output, [r for r in output.num_scheduled_tokens
                    if requests[r].num_output_placeholders > before.get(r, 0)]


def free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.num_free_blocks


# ---------------------------------------------------------------------- placeholders
def test_the_step_behind_a_decode_computes_the_token_in_flight() -> None:
    scheduler = make_scheduler()
    request = make_request("r", 8, max_tokens=4, ignore_eos=True)
    scheduler.add_request(request)
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"r": 8}
    assert request.num_output_placeholders == 1  # the step samples r's first token
    second = scheduler.schedule()  # before the first is updated
    # The decode of position 8: the token the first step is sampling, in a new block.
    assert second.num_scheduled_tokens == {"r": 1}
    assert second.scheduled_cached_reqs.num_computed_tokens == [8]
    assert second.scheduled_cached_reqs.new_block_ids == {"r": [3]}
    assert request.num_computed_tokens == 9 and request.num_output_placeholders == 2
    outputs = update(scheduler, first, {"r": 11})
    assert outputs["r"].new_token_ids == [11] and outputs["r"].finish_reason is None
    assert request.output_token_ids == [11] and request.num_output_placeholders == 1
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"r": 1} and request.num_computed_tokens == 10
    assert update(scheduler, second, {"r": 12})["r"].new_token_ids == [12]
    assert request.all_token_ids[8:] == [11, 12]


def test_a_request_that_stops_drops_the_token_of_the_step_behind_it() -> None:
    scheduler = make_scheduler()
    start = free_blocks(scheduler)
    scheduler.add_request(make_request("r", 7, max_tokens=10, stop_token_ids=[STOP]))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"r": 1}
    outputs = update(scheduler, first, {"r": STOP})
    assert outputs["r"].finish_reason == FinishReason.STOP and outputs["r"].stop_reason == STOP
    # Freed at once, though the step behind still computes a row for it.
    assert free_blocks(scheduler) == start and "r" not in scheduler.requests
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {} and third.finished_req_ids == {"r"}
    # The row computed behind the stop samples a token: nobody gets it.
    assert update(scheduler, second, {"r": 13}) == {}
    assert update(scheduler, third, {}) == {}
    assert not scheduler.has_unfinished_requests() and len(scheduler.in_flight) == 0


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_a_request_whose_token_in_flight_reaches_its_cap_is_not_scheduled_again(
    max_tokens: int,
) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 5, max_tokens=max_tokens, ignore_eos=True))
    steps = [scheduler.schedule()]
    if max_tokens == 2:
        steps.append(scheduler.schedule())
        assert steps[-1].num_scheduled_tokens == {"r": 1}
    # Its last token is in flight: nothing after it would be kept.
    behind = scheduler.schedule()
    assert behind.num_scheduled_tokens == {}
    outputs = [update(scheduler, step, {"r": 20 + i}) for i, step in enumerate(steps)]
    assert [o["r"].new_token_ids for o in outputs] == [[20 + i] for i in range(max_tokens)]
    assert outputs[-1]["r"].finish_reason == FinishReason.LENGTH
    assert update(scheduler, behind, {}) == {}
    assert free_blocks(scheduler) == 31


def test_min_tokens_counts_the_tokens_in_flight() -> None:
    # The stop tokens a step blocks are those the synchronous loop blocks at the same
    # output count: steps sampling outputs 1 and 2 block them, the third does not.
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 3, max_tokens=6, min_tokens=2, stop_token_ids=[STOP]))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert first.blocked_stop_token_ids == {"r": [EOS, STOP]}
    assert second.blocked_stop_token_ids == {"r": [EOS, STOP]}
    update(scheduler, first, {"r": 30})
    third = scheduler.schedule()
    assert third.blocked_stop_token_ids == {}
    update(scheduler, second, {"r": 31})
    outputs = update(scheduler, third, {"r": STOP})
    assert outputs["r"].finish_reason == FinishReason.STOP
    assert outputs["r"].new_token_ids == [STOP]


def test_a_request_preempted_behind_its_step_keeps_that_steps_token() -> None:
    # 5 usable blocks of 4: a and b fill 2 each with their prompts; growing past them in
    # the step behind needs more than the pool has, so b (the last) is preempted while
    # the step sampling its first token is in flight.
    scheduler = make_scheduler(num_blocks=6, max_model_len=20)
    scheduler.add_request(make_request("a", 8, start=100, max_tokens=8, ignore_eos=True))
    scheduler.add_request(make_request("b", 8, start=200, max_tokens=8, ignore_eos=True))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 8, "b": 8}
    second = scheduler.schedule()
    assert second.preempted_req_ids == {"b"} and second.num_scheduled_tokens == {"a": 1}
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    outputs = update(scheduler, first, {"a": 40, "b": 41})
    # Computed before the preemption: b's token is its first output, as in the
    # synchronous loop (where it is appended before the next schedule preempts b).
    assert outputs["b"].new_token_ids == [41] and b.output_token_ids == [41]
    assert b.num_output_placeholders == 0 and b.status == RequestStatus.PREEMPTED
    update(scheduler, second, {"a": 42})
    for _ in range(10):
        output, sampled = schedule(scheduler)
        if "b" in output.num_scheduled_tokens:
            break
        update(scheduler, output, dict.fromkeys(sampled, 43))
    else:
        raise AssertionError("b never resumed")
    [resumed] = [r for r in output.scheduled_new_reqs if r.req_id == "b"]
    assert resumed.token_ids == [*range(200, 208), 41] and resumed.is_resumed


def test_a_preempted_request_whose_token_in_flight_stops_it_ends_in_the_queue() -> None:
    scheduler = make_scheduler(num_blocks=6, max_model_len=20)
    start = free_blocks(scheduler)
    scheduler.add_request(make_request("a", 8, start=100, max_tokens=8, ignore_eos=True))
    scheduler.add_request(make_request("b", 8, start=200, max_tokens=8, stop_token_ids=[STOP]))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert second.preempted_req_ids == {"b"}
    outputs = update(scheduler, first, {"a": 40, "b": STOP})
    assert outputs["b"].finish_reason == FinishReason.STOP
    assert "b" not in scheduler.requests and len(scheduler.waiting) == 0
    update(scheduler, second, {"a": 41})
    assert free_blocks(scheduler) == start - 3  # only a's blocks


# ---------------------------------------------------------------------- prefix cache
def test_blocks_are_indexed_at_the_count_their_step_computed() -> None:
    # A 14-token prompt in chunks of 6 and 8: when the first chunk is updated, the second
    # (scheduled behind it) is still running, so only the first chunk's full block counts.
    scheduler = make_scheduler(enable_caching=True, max_num_batched_tokens=6)
    scheduler.add_request(make_request("r", 14, max_tokens=2, ignore_eos=True))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert (first.num_scheduled_tokens, second.num_scheduled_tokens) == ({"r": 6}, {"r": 6})
    update(scheduler, first, {})
    manager = scheduler.kv_cache_manager
    assert manager.num_cached_blocks["r"] == 1  # 6 tokens: one full block
    third = scheduler.schedule()
    update(scheduler, second, {})
    assert manager.num_cached_blocks["r"] == 3  # 12 tokens
    assert third.num_scheduled_tokens == {"r": 2}


def test_a_waiting_request_waits_for_the_blocks_a_step_in_flight_computes() -> None:
    scheduler = make_scheduler(enable_caching=True)
    prefix = list(range(100, 116))  # 4 full blocks
    a = Request("a", prefix + [50], SamplingParams(max_tokens=3, ignore_eos=True))
    b = Request("b", prefix + [60], SamplingParams(max_tokens=3, ignore_eos=True))
    scheduler.add_request(a)
    first = scheduler.schedule()
    scheduler.add_request(b)
    second = scheduler.schedule()
    # a's blocks enter the cache when the first step is updated: b waits for them.
    assert "b" not in second.num_scheduled_tokens
    update(scheduler, first, {"a": 70})
    third = scheduler.schedule()
    assert third.num_scheduled_tokens["b"] == 1
    assert scheduler.requests["b"].num_cached_tokens == 16


# ---------------------------------------------------------------------- ids and failures
def test_a_reused_id_gets_no_token_of_the_request_that_had_it() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 4, max_tokens=8, stop_token_ids=[STOP]))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert update(scheduler, first, {"r": STOP})["r"].finish_reason == FinishReason.STOP
    fresh = make_request("r", 5, start=300, max_tokens=8, ignore_eos=True)
    scheduler.add_request(fresh)  # the id is free again
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"r": 5} and fresh.num_output_placeholders == 1
    # The old request's row in the step behind drew 77: it must not reach the new one.
    assert update(scheduler, second, {"r": 77}) == {}
    assert fresh.output_token_ids == [] and fresh.num_output_placeholders == 1
    assert update(scheduler, third, {"r": 78})["r"].new_token_ids == [78]


def test_a_failed_step_leaves_the_steps_in_flight_consistent() -> None:
    scheduler = make_scheduler()
    start = free_blocks(scheduler)
    scheduler.add_request(make_request("a", 4, max_tokens=4, ignore_eos=True))
    first = scheduler.schedule()
    scheduler.add_request(make_request("b", 6, start=200, max_tokens=4, ignore_eos=True))
    second = scheduler.schedule()
    update(scheduler, first, {"a": 50})
    failed = scheduler.fail_step(second)
    assert sorted(r.request_id for r in failed) == ["a", "b"]
    assert len(scheduler.in_flight) == 0 and free_blocks(scheduler) == start
    with pytest.raises(KeyError, match="not scheduled by this scheduler"):
        update(scheduler, second, {})


# ---------------------------------------------------------------------- KV transfer
@pytest.fixture
def connector() -> Iterator[KVConnectorScheduler]:
    config = KVTransferConfig(model_id="m", lease_s=1000.0, transfer_key=TEST_KEY)
    metrics = KVTransferMetrics()
    endpoint = ProducerEndpoint("prod-engine", "127.0.0.1", 5555, "agent-a")
    connector = KVConnectorScheduler(config, BLOCK_SIZE, endpoint,
                                     LeaseTable(config.lease_s, metrics), metrics)
    yield connector
    connector.shutdown()


def test_a_producers_prefill_is_not_scheduled_past_its_one_token(connector) -> None:
    scheduler = make_scheduler(num_blocks=16, enable_caching=True, connector=connector)
    start = free_blocks(scheduler)
    params = KVTransferParams.from_dict({"do_remote_decode": True})
    scheduler.add_request(Request("p", list(range(100, 110)),
                                  SamplingParams(max_tokens=4, ignore_eos=True),
                                  kv_transfer_params=params))
    first = scheduler.schedule()
    behind = scheduler.schedule()
    # Its one token is in flight: the step behind computes nothing into its held blocks.
    assert behind.num_scheduled_tokens == {}
    outputs = update(scheduler, first, {"p": 7})
    assert outputs["p"].finish_reason == FinishReason.LENGTH
    returned = KVTransferParams.from_dict(outputs["p"].kv_transfer_params)
    assert returned.remote_block_ids == ((1, 2, 3),)
    assert free_blocks(scheduler) == start - 3 and scheduler.has_request("p")
    update(scheduler, behind, {})
    scheduler.update_from_kv_connector(KVConnectorOutput(finished_sends=["p"]))
    assert free_blocks(scheduler) == start and not scheduler.has_unfinished_requests()


def test_a_pulled_request_decodes_with_a_step_in_flight(connector) -> None:
    scheduler = make_scheduler(num_blocks=16, enable_caching=True, connector=connector)
    start = free_blocks(scheduler)
    params = KVTransferParams.from_dict({
        "do_remote_prefill": True, "remote_engine_id": "prod-engine",
        "remote_host": "127.0.0.1", "remote_port": 1, "remote_block_ids": [5, 6, 7],
        "remote_request_id": "p-1", "kvferry_num_tokens": 10,
        "kvferry_agent_name": "agent-b", "kvferry_lease_s": 30.0,
    })
    params = sign_params(params, TEST_KEY, time.time())
    scheduler.add_request(Request("d", list(range(100, 110)),
                                  SamplingParams(max_tokens=3, ignore_eos=True),
                                  kv_transfer_params=params))
    parked = scheduler.schedule()
    assert parked.num_scheduled_tokens == {}
    update(scheduler, parked, {})
    scheduler.update_from_kv_connector(KVConnectorOutput(finished_pulls=["d"]))
    tokens: list[int] = []
    steps = [scheduler.schedule()]
    assert steps[0].num_scheduled_tokens == {"d": 1}  # the last prompt token
    for token in (81, 82, 83):
        steps.append(scheduler.schedule())
        outputs = update(scheduler, steps.pop(0), {"d": token})
        tokens += outputs["d"].new_token_ids
    assert tokens == [81, 82, 83] and outputs["d"].finish_reason == FinishReason.LENGTH
    assert steps[0].num_scheduled_tokens == {}  # the cap was in flight: nothing behind
    update(scheduler, steps[0], {})
    assert free_blocks(scheduler) == start
