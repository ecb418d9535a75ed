"""Scheduler with a KV connector: the remote-KV state machine, without NIXL.

The real KVConnectorScheduler decides; the test plays the worker (it writes the
KVConnectorOutput a transfer thread would report) and the runner (fixed sampled tokens).
Block size 4, 16 blocks (block 0 is the null block).
"""

import time
from collections.abc import Iterator

import pytest
from kvferry.engine.config import SchedulerConfig
from kvferry.engine.core.kv_cache import KVCacheManager
from kvferry.engine.core.kv_connector import TransferFailure
from kvferry.engine.core.messages import FinishReason
from kvferry.engine.core.request import Request, RequestStatus
from kvferry.engine.core.scheduler import Scheduler
from kvferry.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvferry.engine.sampling_params import SamplingParams
from kvferry.kvtransfer import (
    FailureReason,
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
NUM_BLOCKS = 16
TOKEN = 7


def make_scheduler(policy: str = "recompute") -> tuple[Scheduler, KVConnectorScheduler]:
    # A lease long enough that no heartbeat is due while a test runs.
    config = KVTransferConfig(model_id="m", lease_s=1000.0, failure_policy=policy,
                              transfer_key=TEST_KEY)
    metrics = KVTransferMetrics()
    endpoint = ProducerEndpoint("prod-engine", "127.0.0.1", 5555, "agent-a")
    connector = KVConnectorScheduler(
        config, BLOCK_SIZE, endpoint, LeaseTable(config.lease_s, metrics), metrics
    )
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=True)
    sched_config = SchedulerConfig(max_model_len=64, max_num_batched_tokens=64)
    return Scheduler(sched_config, manager, connector), connector


@pytest.fixture
def pair() -> Iterator[tuple[Scheduler, KVConnectorScheduler]]:
    scheduler, connector = make_scheduler()
    yield scheduler, connector
    connector.shutdown()


def remote_params(num_tokens: int, block_ids: list[int]) -> KVTransferParams:
    """Params as a producer of the service returns them (signed with its key)."""
    params = KVTransferParams.from_dict({
        "do_remote_prefill": True, "remote_engine_id": "prod-engine",
        "remote_host": "127.0.0.1", "remote_port": 1, "remote_block_ids": block_ids,
        "remote_request_id": "p-1", "kvferry_num_tokens": num_tokens,
        "kvferry_agent_name": "agent-b", "kvferry_lease_s": 30.0,
    })
    assert params is not None
    return sign_params(params, TEST_KEY, time.time())


def make_request(req_id: str, num_tokens: int, params: KVTransferParams | None) -> Request:
    return Request(
        request_id=req_id, prompt_token_ids=list(range(100, 100 + num_tokens)),
        sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
        kv_transfer_params=params,
    )


def run_step(scheduler: Scheduler) -> tuple[SchedulerOutput, list]:
    output = scheduler.schedule()
    sampled = [r for r, n in output.num_scheduled_tokens.items()
               if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens]
    runner = ModelRunnerOutput(req_ids=sampled, sampled_token_ids=[TOKEN] * len(sampled))
    return output, scheduler.update_from_output(output, runner)


def free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.num_free_blocks


def test_pull_parks_then_schedules_only_the_last_prompt_token(pair) -> None:
    scheduler, connector = pair
    start = free_blocks(scheduler)
    scheduler.add_request(make_request("d", 10, remote_params(10, [5, 6, 7])))
    output, _ = run_step(scheduler)
    request = scheduler.requests["d"]
    # 9 tokens arrive remotely (the last is computed here): 3 blocks, nothing scheduled.
    assert output.num_scheduled_tokens == {}
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert scheduler.kv_cache_manager.get_block_ids("d") == [1, 2, 3]
    meta = connector.build_connector_meta()
    assert [(p.local_block_ids, p.remote_block_ids) for p in meta.pulls] == [
        (((1, 2, 3),), ((5, 6, 7),))]
    # Still parked while the worker reports nothing.
    output, _ = run_step(scheduler)
    assert output.num_scheduled_tokens == {} and scheduler.has_unfinished_requests()
    outputs = scheduler.update_from_kv_connector(KVConnectorOutput(finished_pulls=["d"]))
    assert outputs == []
    output, step_outputs = run_step(scheduler)
    assert output.num_scheduled_tokens == {"d": 1}
    assert output.scheduled_new_reqs[0].num_computed_tokens == 9
    assert [o.new_token_ids for o in step_outputs] == [[TOKEN]]
    # The pulled blocks were indexed once the pull succeeded: 2 full blocks.
    assert scheduler.kv_cache_manager.num_cached_blocks["d"] >= 2
    while scheduler.has_requests_to_compute():
        run_step(scheduler)
    assert free_blocks(scheduler) == start


def test_pulled_tokens_filling_whole_blocks_leave_one_new_block_for_the_last_token(
        pair) -> None:
    """9 tokens: 8 pulled fill blocks 1-2 exactly, the last prompt token takes a third block
    when the request is scheduled, and no more (its pulled tokens are not counted twice)."""
    scheduler, connector = pair
    start = free_blocks(scheduler)
    scheduler.add_request(make_request("d", 9, remote_params(9, [5, 6])))
    run_step(scheduler)
    assert scheduler.kv_cache_manager.get_block_ids("d") == [1, 2]
    scheduler.update_from_kv_connector(KVConnectorOutput(finished_pulls=["d"]))
    output, step_outputs = run_step(scheduler)
    assert output.num_scheduled_tokens == {"d": 1}
    assert output.scheduled_new_reqs[0].num_computed_tokens == 8
    assert scheduler.kv_cache_manager.get_block_ids("d") == [1, 2, 3]
    assert list(output.scheduled_new_reqs[0].block_ids) == [1, 2, 3]
    assert [o.new_token_ids for o in step_outputs] == [[TOKEN]]
    while scheduler.has_requests_to_compute():
        run_step(scheduler)
    assert free_blocks(scheduler) == start


def test_local_prefix_hits_shorten_the_pull(pair) -> None:
    scheduler, connector = pair
    scheduler.add_request(make_request("a", 10, None))
    while scheduler.has_requests_to_compute():
        run_step(scheduler)
    scheduler.add_request(make_request("d", 10, remote_params(10, [5, 6, 7])))
    run_step(scheduler)
    pulls = connector.build_connector_meta().pulls
    # Two blocks (8 tokens) are local hits; only the third block is pulled.
    assert [(p.remote_block_ids) for p in pulls] == [((7,),)]
    assert scheduler.requests["d"].num_computed_tokens == 8


def test_failed_pull_recomputes_and_counts_a_fallback(pair) -> None:
    scheduler, connector = pair
    start = free_blocks(scheduler)
    scheduler.add_request(make_request("d", 10, remote_params(10, [5, 6, 7])))
    run_step(scheduler)
    connector.build_connector_meta()
    failure = TransferFailure(FailureReason.TIMEOUT, "too slow")
    assert scheduler.update_from_kv_connector(KVConnectorOutput(failed_pulls={"d": failure})) == []
    # Nothing of the failed pull is in the prefix cache.
    assert not scheduler.kv_cache_manager.block_pool.cached_blocks
    output, _ = run_step(scheduler)
    assert output.num_scheduled_tokens == {"d": 10}
    assert scheduler.make_stats().num_kv_transfer_fallbacks == 1
    while scheduler.has_requests_to_compute():
        run_step(scheduler)
    assert free_blocks(scheduler) == start


def test_failed_pull_under_fail_policy_ends_with_an_error() -> None:
    scheduler, connector = make_scheduler("fail")
    try:
        start = free_blocks(scheduler)
        scheduler.add_request(make_request("d", 10, remote_params(10, [5, 6, 7])))
        run_step(scheduler)
        failure = TransferFailure(FailureReason.PRODUCER_UNREACHABLE, "refused")
        outputs = scheduler.update_from_kv_connector(KVConnectorOutput(failed_pulls={"d": failure}))
        assert [(o.req_id, o.finish_reason) for o in outputs] == [("d", FinishReason.ERROR)]
        assert "producer_unreachable" in outputs[0].error
        assert free_blocks(scheduler) == start and not scheduler.has_unfinished_requests()
    finally:
        connector.shutdown()


def test_abort_mid_pull_keeps_blocks_until_the_worker_lets_go(pair) -> None:
    scheduler, connector = pair
    start = free_blocks(scheduler)
    scheduler.add_request(make_request("d", 10, remote_params(10, [5, 6, 7])))
    run_step(scheduler)
    connector.build_connector_meta()
    scheduler.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    assert free_blocks(scheduler) == start - 3
    assert connector.build_connector_meta().cancelled == ["d"]
    assert scheduler.has_unfinished_requests()
    scheduler.update_from_kv_connector(KVConnectorOutput(cancelled_pulls=["d"]))
    assert free_blocks(scheduler) == start and not scheduler.has_unfinished_requests()


def test_producer_finishes_after_one_token_and_holds_blocks(pair) -> None:
    scheduler, connector = pair
    start = free_blocks(scheduler)
    params = KVTransferParams.from_dict({"do_remote_decode": True})
    scheduler.add_request(make_request("p", 10, params))
    _, outputs = run_step(scheduler)
    [out] = outputs
    assert out.new_token_ids == [TOKEN] and out.finish_reason == FinishReason.LENGTH
    returned = KVTransferParams.from_dict(out.kv_transfer_params)
    assert returned.do_remote_prefill and returned.remote_block_ids == ((1, 2, 3),)
    assert returned.remote_request_id == "p" and returned.kvferry_num_tokens == 10
    assert free_blocks(scheduler) == start - 3 and scheduler.has_unfinished_requests()
    # Its id stays taken while its blocks are held.
    assert scheduler.has_request("p")
    scheduler.update_from_kv_connector(KVConnectorOutput(finished_sends=["p"]))
    assert not scheduler.has_request("p")
    assert free_blocks(scheduler) == start and not scheduler.has_unfinished_requests()


def test_params_without_a_connector_are_refused() -> None:
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), manager)
    with pytest.raises(ValueError, match="KV transfer"):
        scheduler.add_request(make_request("d", 10, remote_params(10, [5, 6, 7])))


def test_a_prompt_all_in_the_local_prefix_cache_pulls_nothing(pair) -> None:
    scheduler, connector = pair
    scheduler.add_request(make_request("a", 9, None))
    while scheduler.has_requests_to_compute():
        run_step(scheduler)
    scheduler.add_request(make_request("d", 9, remote_params(9, [5, 6, 7])))
    output, _ = run_step(scheduler)
    # 8 tokens are hits, the 9th is computed here: no pull, the params are spent.
    assert output.num_scheduled_tokens == {"d": 1}
    assert connector.build_connector_meta().pulls == []
    assert scheduler.requests["d"].kv_transfer_params is None
    assert connector.num_pulls_in_flight == 0


def test_blocks_held_for_another_prompt_are_never_pulled(pair) -> None:
    scheduler, connector = pair
    producer_side = make_request("p", 10, KVTransferParams.from_dict({"do_remote_decode": True}))
    scheduler.add_request(producer_side)
    _, [out] = run_step(scheduler)
    held = KVTransferParams.from_dict(out.kv_transfer_params)
    assert held.kvferry_prompt_hash is not None
    other = make_request("d", 10, held)
    other.prompt_token_ids[3] += 1
    other.all_token_ids[3] += 1
    scheduler.add_request(other)
    output, _ = run_step(scheduler)
    assert output.num_scheduled_tokens == {"d": 10}
    assert connector.build_connector_meta().pulls == []
    assert scheduler.make_stats().num_kv_transfer_fallbacks == 1
