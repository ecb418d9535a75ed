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
from kvferry.kvtransfer.auth import SideChannelAuth, TransferKey, check_params, sign_params
from kvferry.kvtransfer.lease import LeaseTable
from kvferry.kvtransfer.metrics import HoldEnd
from kvferry.kvtransfer.params import prompt_hash
from kvferry.kvtransfer.side_channel import SideChannelServer
from kvferry_testing.handshakes import handshake_info
from kvferry_testing.keys import TEST_KEY
from kvferry_testing.listeners import SilentListener

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
    server = SideChannelServer("127.0.0.1", 0, handshake_info(), producer,
                               SideChannelAuth(TEST_KEY))
    server.start()
    config = KVTransferConfig(heartbeat_interval_s=0.05, lease_s=30.0, transfer_key=TEST_KEY)
    metrics = KVTransferMetrics()
    endpoint = ProducerEndpoint("decode-0", "10.0.0.9", 7000, "agent-d")
    scheduler = KVConnectorScheduler(config, BLOCK, endpoint, LeaseTable(30.0, metrics), metrics)
    yield Setup(scheduler, producer, server.port)
    scheduler.shutdown()
    server.close()


def remote_params(port: int, block_ids: list[int], num_tokens: int,
                  req_id: str = "p1", key: TransferKey = TEST_KEY) -> KVTransferParams:
    """Params as the producer on `port` would return them, signed with `key`."""
    params = KVTransferParams(
        do_remote_prefill=True, remote_engine_id="e1", remote_host="127.0.0.1",
        remote_port=port, remote_block_ids=(tuple(block_ids),), remote_request_id=req_id,
        kvferry_agent_name="agent-1", kvferry_num_tokens=num_tokens, kvferry_lease_s=30.0,
    )
    return sign_params(params, key, time.time())


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
    params = sign_params(replace(remote_params(setup.port, [1], BLOCK),
                                 remote_block_ids=((11, 12), (30, 31, 32))), TEST_KEY, time.time())
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


def test_a_heartbeat_that_crosses_the_reads_notification_loses_nothing(setup: Setup) -> None:
    """The read finishes and its notification ends the producer's hold before the engine
    hears of the read; heartbeats meanwhile find the hold gone, ended by this consumer's own
    read: the pull stands. A hold that ended any other way is lost."""
    for req_id in ("pulled", "freed"):
        params = remote_params(setup.port, [11], BLOCK, req_id=f"p-{req_id}")
        setup.producer.hold(f"p-{req_id}", ((11,),))
        setup.scheduler.add_request(req_id, params)
        setup.scheduler.update_state_after_alloc(req_id, params, [[21]], 0, BLOCK - 1)
    wait_until(lambda: setup.producer.readers() == {"p-pulled": "agent-d", "p-freed": "agent-d"})
    assert setup.producer.end("p-pulled", HoldEnd.PULLED, reader="agent-d")
    assert setup.producer.end("p-freed", HoldEnd.FREED, reader="agent-d")
    wait_until(lambda: setup.scheduler._keeper.is_lost("p-freed".removeprefix("p-")))
    time.sleep(0.2)  # four more heartbeats
    assert not setup.scheduler._keeper.is_lost("pulled")

    done = setup.scheduler.get_finished(KVConnectorOutput(finished_pulls=["pulled", "freed"]))

    assert done.ready == ["pulled"]
    assert done.failed["freed"].reason is FailureReason.LEASE_LOST


def test_a_prefill_for_remote_decode_holds_its_blocks_and_returns_params(setup: Setup) -> None:
    scheduler = setup.scheduler
    params = KVTransferParams(do_remote_decode=True)

    tokens = list(range(3 * BLOCK + 2))  # the prompt and the sampled token
    keep, out = scheduler.request_finished("p", params, [[5, 6, 7, 8]], tokens, 3 * BLOCK + 1,
                                           aborted=False)

    assert keep and out is not None
    # Signed with the service's key, valid for one lease.
    returned = KVTransferParams.from_dict(out)
    assert returned is not None and check_params(returned, TEST_KEY, time.time()) is None
    assert time.time() + 29 <= out.pop("kvferry_expires_at") <= time.time() + 31
    assert len(out.pop("kvferry_mac")) == 64
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


def test_a_decode_pod_holds_nothing_for_a_remote_decode(setup: Setup) -> None:
    config = replace(setup.scheduler.config, role="decode")
    metrics = KVTransferMetrics()
    endpoint = ProducerEndpoint("decode-0", "10.0.0.9", 7000, "agent-d")
    decode = KVConnectorScheduler(config, BLOCK, endpoint, LeaseTable(30.0, metrics), metrics)
    try:
        assert decode.request_finished("p", KVTransferParams(do_remote_decode=True), [[5, 6]],
                                       [TOKEN] * 2 * BLOCK, 2 * BLOCK, False) == (False, None)
        assert decode._leases.num_blocks_held == 0
    finally:
        decode.shutdown()


def test_a_connector_without_a_key_or_insecure_does_not_start() -> None:
    endpoint = ProducerEndpoint("decode-0", "10.0.0.9", 7000, "agent-d")
    metrics = KVTransferMetrics()
    with pytest.raises(ValueError, match="needs the service's transfer_key"):
        KVConnectorScheduler(KVTransferConfig(), BLOCK, endpoint, LeaseTable(30.0, metrics),
                             metrics)


# ---------------------------------------------------------------------------- forged params
OTHER_KEY = TransferKey(b"another-service-transfer-key-0123456789")


def forged(port: int, how: str) -> KVTransferParams:
    """Params naming the listener on `port`: unsigned, signed with another key, altered
    after signing, or signed but expired."""
    if how == "unsigned":
        return replace(remote_params(port, [11], BLOCK), kvferry_mac=None)
    if how == "another key":
        return remote_params(port, [11], BLOCK, key=OTHER_KEY)
    if how == "altered":
        return replace(remote_params(port + 1, [11], BLOCK), remote_port=port)
    params = replace(remote_params(port, [11], BLOCK), kvferry_lease_s=1.0)
    return sign_params(params, TEST_KEY, time.time() - 60)


@pytest.mark.parametrize(
    ("how", "reason"),
    [("unsigned", FailureReason.BAD_SIGNATURE), ("another key", FailureReason.BAD_SIGNATURE),
     ("altered", FailureReason.BAD_SIGNATURE), ("expired", FailureReason.PARAMS_EXPIRED)],
)
@pytest.mark.parametrize("num_external", [BLOCK - 1, 0])
def test_forged_params_make_no_connection_to_the_address_they_name(
    setup: Setup, how: str, reason: FailureReason, num_external: int
) -> None:
    """Neither a handshake, a heartbeat nor a free reaches the named address; the pull
    fails with the reason (counted), or is computed here without telling anyone."""
    listener = SilentListener()
    try:
        params = forged(listener.port, how)
        scheduler = setup.scheduler
        scheduler.add_request("d", params)
        assert scheduler.get_num_new_matched_tokens(params, [TOKEN] * BLOCK, 0) == BLOCK - 1
        scheduler.update_state_after_alloc("d", params, [[21]], 0, num_external)
        assert scheduler.build_connector_meta().pulls == []
        done = scheduler.get_finished(KVConnectorOutput())
        if num_external:
            assert done.failed["d"].reason is reason
        else:
            assert done.failed == {}
        scheduler.request_finished("d", params, [[21]], [TOKEN] * BLOCK, 0, aborted=True)
        # Heartbeats every 50 ms and frees would have had time to go out.
        time.sleep(0.3)
        scheduler.shutdown()
        assert listener.num_accepted == 0
        assert scheduler._metrics.snapshot().failures == {reason.value: 1}
    finally:
        listener.close()


def test_signed_params_reach_the_producer(setup: Setup) -> None:
    """The same path with correctly signed params does contact the producer (a heartbeat
    claims the hold), so the test above shows the signature, not a dead path."""
    setup.producer.hold("p1", ((11,),))
    setup.scheduler.add_request("d", remote_params(setup.port, [11], BLOCK))
    wait_until(lambda: setup.producer.readers() == {"p1": "agent-d"})



def test_a_hold_given_to_two_requests_is_freed_only_when_both_let_it_go(setup: Setup) -> None:
    """A decode hop retried on the same pod brings the same params twice: the first to let
    go must not free the blocks the other may be reading."""
    setup.producer.hold("p1", ((11,),))
    params = remote_params(setup.port, [11], BLOCK)
    setup.scheduler.add_request("a", params)
    setup.scheduler.add_request("b", params)
    setup.scheduler._keeper.release("a")
    time.sleep(0.3)  # six heartbeat intervals: a free would have gone
    assert setup.producer.is_held("p1")
    setup.scheduler._keeper.release("b")
    wait_until(lambda: not setup.producer.is_held("p1"))
