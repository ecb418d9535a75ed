"""The scheduler side of the connector, with a producer's side channel on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
from kvferry.engine.core.kv_connector import TransferFailure
from kvferry.kvtransfer import (
    FailureReason,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVTransferConfig,
    KVTransferMetrics,
    KVTransferParams,
    ProducerEndpoint,
    PullSpec,
)
from kvferry.kvtransfer.lease import LeaseTable
from kvferry.kvtransfer.params import prompt_hash
from kvferry.kvtransfer.side_channel import SideChannelServer
from kvferry_testing.handshakes import handshake_info

BLOCK = 16
TOKEN = 7  # a prompt token id (the params these tests build carry no prompt hash)


@dataclass
class Setup:
    scheduler: KVConnectorScheduler
    # The producer this scheduler's requests pull from.
    producer: LeaseTable
    port: int


@pytest.fixture
def setup() -> Iterator[Setup]:
    producer = LeaseTable(30.0, KVTransferMetrics())
    server = SideChannelServer("127.0.0.1", 0, handshake_info(), producer)
    server.start()
    config = KVTransferConfig(heartbeat_interval_s=0.05, lease_s=30.0)
    metrics = KVTransferMetrics()
    endpoint = ProducerEndpoint("decode-0", "10.0.0.9", 7000, "agent-d")
    scheduler = KVConnectorScheduler(config, BLOCK, endpoint, LeaseTable(30.0, metrics), metrics)
    yield Setup(scheduler, producer, server.port)
    scheduler.shutdown()
    server.close()


def remote_params(port: int, block_ids: list[int], num_tokens: int,
                  req_id: str = "p1") -> KVTransferParams:
    return KVTransferParams(
        do_remote_prefill=True, remote_engine_id="e1", remote_host="127.0.0.1",
        remote_port=port, remote_block_ids=(tuple(block_ids),), remote_request_id=req_id,
        kvferry_agent_name="agent-1", kvferry_num_tokens=num_tokens,
    )


def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.01)


def test_local_requests_match_nothing(setup: Setup) -> None:
    assert setup.scheduler.get_num_new_matched_tokens(None, [TOKEN] * 40, 0) == 0
    assert setup.scheduler.get_num_new_matched_tokens(KVTransferParams(do_remote_decode=True),
                                                      [TOKEN] * 40, 0) == 0


@pytest.mark.parametrize(
    ("num_prompt", "num_remote", "num_computed", "expected"),
    [
        (33, 33, 0, 32),  # the last prompt token is computed here
        (33, 33, 16, 16),  # prefix hits shorten the pull
        (32, 32, 16, 15),
        (17, 17, 16, 0),  # everything but the last token is a local hit
        (40, 20, 0, 20),  # the producer computed fewer tokens than the prompt has
    ],
)
def test_matched_tokens_are_the_remote_ones_past_local_hits(
    setup: Setup, num_prompt: int, num_remote: int, num_computed: int, expected: int
) -> None:
    params = remote_params(setup.port, [1, 2, 3], num_remote)
    prompt = [TOKEN] * num_prompt
    assert setup.scheduler.get_num_new_matched_tokens(params, prompt, num_computed) == expected


def test_a_pull_pairs_the_blocks_past_the_local_hits(setup: Setup) -> None:
    params = remote_params(setup.port, [11, 12, 13, 14], 4 * BLOCK)
    setup.scheduler.update_state_after_alloc("d", params, [[21, 22, 23, 24]], BLOCK,
                                             3 * BLOCK - 1)
    meta = setup.scheduler.build_connector_meta()
    assert meta.pulls == [PullSpec("d", params, ((22, 23, 24),), ((12, 13, 14),))]
    assert setup.scheduler.build_connector_meta().pulls == []
    assert setup.scheduler.num_pulls_in_flight == 1


def test_cross_attention_blocks_are_pulled_whole(setup: Setup) -> None:
    params = replace(remote_params(setup.port, [1], BLOCK),
                     remote_block_ids=((11, 12), (30, 31, 32)))
    setup.scheduler.update_state_after_alloc("d", params, [[21, 22], [40, 41, 42]], 0,
                                             2 * BLOCK - 1)
    (spec,) = setup.scheduler.build_connector_meta().pulls
    assert spec.local_block_ids == ((21, 22), (40, 41, 42))
    assert spec.remote_block_ids == ((11, 12), (30, 31, 32))


def test_too_few_remote_blocks_fail_the_pull_and_free_the_producer(setup: Setup) -> None:
    setup.producer.hold("p1", ((11,),))
    params = remote_params(setup.port, [11], 3 * BLOCK)
    setup.scheduler.add_request("d", params)
    setup.scheduler.update_state_after_alloc("d", params, [[21, 22, 23]], 0, 3 * BLOCK - 1)

    assert setup.scheduler.build_connector_meta().pulls == []
    done = setup.scheduler.get_finished(KVConnectorOutput())
    assert done.failed["d"].reason is FailureReason.INVALID_PARAMS
    assert "3 blocks to pull, 3 allocated here, 1 sent by the producer" in done.failed["d"].message
    wait_until(lambda: not setup.producer.is_held("p1"))


def test_computing_everything_locally_frees_the_producer(setup: Setup) -> None:
    setup.producer.hold("p1", ((11, 12),))
    params = remote_params(setup.port, [11, 12], 17)
    setup.scheduler.add_request("d", params)
    setup.scheduler.update_state_after_alloc("d", params, [[21, 22]], 16, 0)
    wait_until(lambda: not setup.producer.is_held("p1"))
    assert setup.scheduler.build_connector_meta().pulls == []


def test_heartbeats_keep_a_queued_request_alive(setup: Setup) -> None:
    setup.producer.lease_s = 0.3
    setup.producer.hold("p1", ((11,),))
    setup.scheduler.add_request("d", remote_params(setup.port, [11], BLOCK))
    time.sleep(1.0)
    assert setup.producer.expire() == []
    assert setup.producer.is_held("p1")


def test_worker_reports_become_scheduler_actions(setup: Setup) -> None:
    for req_id in ("ok", "bad", "gone"):
        params = remote_params(setup.port, [11], BLOCK, req_id=f"p-{req_id}")
        setup.producer.hold(f"p-{req_id}", ((11,),))
        setup.scheduler.add_request(req_id, params)
        setup.scheduler.update_state_after_alloc(req_id, params, [[21]], 0, BLOCK - 1)
    # "gone" is aborted by its client while its pull runs: its blocks wait for the worker.
    keep, _ = setup.scheduler.request_finished("gone", None, [[21]], [TOKEN], 0, aborted=True)
    assert keep
    assert setup.scheduler.build_connector_meta().cancelled == ["gone"]

    failure = TransferFailure(FailureReason.TRANSFER_ERROR, "read failed")
    done = setup.scheduler.get_finished(KVConnectorOutput(
        finished_pulls=["ok"], failed_pulls={"bad": failure}, cancelled_pulls=["gone"],
        finished_sends=["prefill-9"],
    ))

    assert done.ready == ["ok"]
    assert done.failed == {"bad": failure}
    assert sorted(done.free) == ["gone", "prefill-9"]
    assert setup.scheduler.num_pulls_in_flight == 0
    # The failed and cancelled pulls freed their producer holds; the finished one did not
    # need to (its notification did).
    wait_until(lambda: not setup.producer.is_held("p-bad") and not setup.producer.is_held("p-gone"))
    assert setup.producer.is_held("p-ok")


def test_a_pull_whose_hold_was_lost_fails_even_if_the_read_finished(setup: Setup) -> None:
    params = remote_params(setup.port, [11], BLOCK)
    setup.scheduler.add_request("d", params)  # the producer holds nothing under "p1"
    setup.scheduler.update_state_after_alloc("d", params, [[21]], 0, BLOCK - 1)
    wait_until(lambda: setup.scheduler._keeper.is_lost("d"))

    done = setup.scheduler.get_finished(KVConnectorOutput(finished_pulls=["d"]))

    assert done.ready == []
    assert done.failed["d"].reason is FailureReason.LEASE_LOST


def test_a_prefill_for_remote_decode_holds_its_blocks_and_returns_params(setup: Setup) -> None:
    scheduler = setup.scheduler
    params = KVTransferParams(do_remote_decode=True)

    tokens = list(range(3 * BLOCK + 2))  # the prompt and the sampled token
    keep, out = scheduler.request_finished("p", params, [[5, 6, 7, 8]], tokens, 3 * BLOCK + 1,
                                           aborted=False)

    assert keep
    assert out == {
        "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "decode-0",
        "remote_host": "10.0.0.9", "remote_port": 7000, "remote_block_ids": [5, 6, 7, 8],
        "remote_request_id": "p", "kvferry_agent_name": "agent-d",
        "kvferry_num_tokens": 3 * BLOCK + 1, "kvferry_lease_s": 30.0,
        "kvferry_protocol_version": 2,
        # Of the tokens whose KV the blocks hold: the prompt, not the sampled token.
        "kvferry_prompt_hash": prompt_hash(tokens[:3 * BLOCK + 1]),
    }
    assert scheduler._leases.num_blocks_held == 4


def test_only_blocks_with_computed_tokens_are_held(setup: Setup) -> None:
    params = KVTransferParams(do_remote_decode=True)
    _, out = setup.scheduler.request_finished("p", params, [[5, 6, 7]], [TOKEN] * 2 * BLOCK,
                                              2 * BLOCK, False)
    assert out is not None and out["remote_block_ids"] == [5, 6]


@pytest.mark.parametrize(
    ("params", "aborted"),
    [(None, False), (KVTransferParams(), False), (KVTransferParams(do_remote_decode=True), True)],
)
def test_other_finished_requests_free_their_blocks(
    setup: Setup, params: KVTransferParams | None, aborted: bool
) -> None:
    assert setup.scheduler.request_finished("p", params, [[5]], [TOKEN] * BLOCK, BLOCK,
                                            aborted) == (False, None)
    assert setup.scheduler._leases.num_blocks_held == 0
