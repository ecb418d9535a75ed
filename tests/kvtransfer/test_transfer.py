"""Pulls between a producer process and a consumer, over real NIXL on loopback."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import time

import numpy as np
import pytest
from kvferry.kvtransfer import FailureReason
from kvferry.kvtransfer.auth import sign_params
from kvferry.kvtransfer.layout import block_runs
from kvferry_testing.keys import TEST_KEY
from kvferry_testing.kvt_harness import SMALL, Consumer, Producer, block_bytes, prompt
from kvferry_testing.kvt_producer import fill_cache
from kvferry_testing.listeners import SilentListener


def random_block_ids(rng: np.random.Generator, count: int, num_blocks: int) -> list[int]:
    """`count` distinct ids in [1, num_blocks): runs of 1-5 consecutive ids, gaps between."""
    ids: list[int] = []
    next_id = int(rng.integers(1, 4))
    while len(ids) < count:
        run = min(int(rng.integers(1, 6)), count - len(ids))
        ids.extend(range(next_id, next_id + run))
        next_id += run + int(rng.integers(0, 3))
    assert ids[-1] < num_blocks
    order = rng.permutation(len(ids)) if rng.random() < 0.3 else np.arange(len(ids))
    return [ids[i] for i in order]


def test_pulled_blocks_equal_the_producers_byte_for_byte(producers, make_consumer) -> None:
    producer: Producer = producers(seed=10)
    expected = fill_cache({**SMALL, "seed": 10}, 0)
    rng = np.random.default_rng(0)
    coalesced = 0
    for pull in range(4):
        consumer: Consumer = make_consumer()
        count = int(rng.integers(4, 16))
        remote_ids = random_block_ids(rng, count, SMALL["num_blocks"])
        local_ids = random_block_ids(rng, count, SMALL["num_blocks"])
        num_tokens = count * SMALL["block_size"]
        params = producer.hold(f"prefill-{pull}", [remote_ids], num_tokens)

        assert consumer.pull(f"decode-{pull}", params, [local_ids], num_tokens) is None

        pulled = consumer.caches[0]
        assert block_bytes(pulled, local_ids) == block_bytes(expected, remote_ids)
        digests = producer.call("digest", group=0, block_ids=remote_ids)["sha256"]
        assert [hashlib.sha256(block_bytes(pulled, [b])).hexdigest() for b in local_ids] == digests
        # Nothing else was written.
        untouched = sorted(set(range(SMALL["num_blocks"])) - set(local_ids))
        assert not pulled[untouched].any()
        stats = consumer.metrics.snapshot()
        runs = block_runs(np.array(local_ids), np.array(remote_ids))
        coalesced += len(runs) < count
        assert stats.descriptors == len(runs)
        assert stats.bytes_pulled == count * pulled[0].numel() * pulled.element_size()
        assert stats.pulls_finished == 1
    # The sets had runs that merged into fewer descriptors than blocks.
    assert coalesced >= 2


@pytest.mark.parametrize("read_threads", [2, 3])
def test_a_split_pull_moves_the_same_bytes_and_notifies_once(
    producers, make_consumer, read_threads: int
) -> None:
    producer = producers(seed=11)
    expected = fill_cache({**SMALL, "seed": 11}, 0)
    # Every pull is split, whatever its size.
    consumer = make_consumer(read_threads=read_threads, read_split_min_bytes=0)
    rng = np.random.default_rng(3)
    remote_ids = random_block_ids(rng, 13, SMALL["num_blocks"])
    local_ids = random_block_ids(rng, 13, SMALL["num_blocks"])
    params = producer.hold("p", [remote_ids], 13 * SMALL["block_size"])

    assert consumer.pull("d", params, [local_ids], 13 * SMALL["block_size"]) is None

    pulled = consumer.caches[0]
    assert block_bytes(pulled, local_ids) == block_bytes(expected, remote_ids)
    untouched = sorted(set(range(SMALL["num_blocks"])) - set(local_ids))
    assert not pulled[untouched].any()
    # The parts' descriptors: the runs, plus at most one cut per boundary between parts.
    runs = len(block_runs(np.array(local_ids), np.array(remote_ids)))
    first = consumer.metrics.snapshot().descriptors
    assert runs <= first <= runs + read_threads - 1
    # One notification, once every part was done, ended the hold.
    status = producer.wait_ended("p")
    assert (status["stats"]["sends_pulled"], status["stats"]["lease_expirations"]) == (1, 0)
    # One run of blocks is cut into one descriptor per part.
    params = producer.hold("q", [list(range(3, 16))], 13 * SMALL["block_size"])
    assert consumer.pull("e", params, [list(range(20, 33))], 13 * SMALL["block_size"]) is None
    assert consumer.metrics.snapshot().descriptors - first == read_threads
    assert block_bytes(pulled, list(range(20, 33))) == block_bytes(expected, list(range(3, 16)))
    assert producer.wait_ended("q")["stats"]["sends_pulled"] == 2


def test_consecutive_blocks_move_with_one_descriptor(producers, make_consumer) -> None:
    producer = producers()
    consumer = make_consumer()
    params = producer.hold("p", [list(range(10, 30))], 20 * SMALL["block_size"])

    assert consumer.pull("d", params, [list(range(40, 60))], 20 * SMALL["block_size"]) is None

    assert consumer.metrics.snapshot().descriptors == 1
    expected = fill_cache(SMALL, 0)
    assert block_bytes(consumer.caches[0], list(range(40, 60))) == block_bytes(
        expected, list(range(10, 30)))
def test_the_notification_of_a_finished_pull_frees_the_producers_blocks(
    producers, make_consumer
) -> None:
    producer = producers()
    consumer = make_consumer()
    params = producer.hold("p", [[3, 4, 5]], 12)
    assert producer.call("status")["blocks_held"] == 3

    assert consumer.pull("d", params, [[7, 8, 9]], 12) is None

    status = producer.wait_ended("p")
    assert status["blocks_held"] == 0
    assert status["stats"]["sends_pulled"] == 1
    assert status["stats"]["lease_expirations"] == 0


def test_the_lease_frees_blocks_that_no_one_pulls(producers) -> None:
    producer = producers(lease_s=0.5)
    producer.hold("p", [[3, 4]], 8)
    started = time.monotonic()

    status = producer.wait_ended("p", timeout=5)

    assert 0.4 < time.monotonic() - started < 5
    assert status["blocks_held"] == 0
    assert status["stats"]["lease_expirations"] == 1


def test_heartbeats_extend_the_lease_of_a_waiting_request(producers, make_consumer) -> None:
    producer = producers(lease_s=1.0)
    consumer = make_consumer(heartbeat_interval_s=0.2)
    params = producer.hold("p", [[3, 4]], 8)
    # Queued on the decode side, not yet allocated: only heartbeats keep the hold.
    consumer.scheduler.add_request("d", params)

    time.sleep(3.0)
    assert producer.call("status")["blocks_held"] == 2

    # It is cancelled while queued: the consumer frees the hold at once.
    keep, _ = consumer.scheduler.request_finished("d", params, [], prompt(8), 0, aborted=True)
    assert not keep
    status = producer.wait_ended("p", timeout=5)
    assert status["stats"]["lease_expirations"] == 0
    assert status["stats"]["sends_freed"] == 1


def test_a_mismatched_layout_is_refused_at_handshake_naming_the_field(
    producers, make_consumer
) -> None:
    producer = producers(num_kv_heads=4)
    consumer = make_consumer(num_kv_heads=2)
    params = producer.hold("p", [[3, 4]], 8)

    failure = consumer.pull("d", params, [[5, 6]], 8)

    assert failure is not None and failure.reason is FailureReason.INCOMPATIBLE
    assert "num_kv_heads is 4 there and 2 here" in failure.message
    assert not consumer.caches[0].any()
    # The refused pull freed the producer's hold rather than waiting out the lease.
    assert producer.wait_ended("p", timeout=5)["stats"]["sends_freed"] == 1


def test_a_different_model_is_refused(producers, make_consumer) -> None:
    producer = producers(model_id="model-a")
    consumer = make_consumer(model_id="model-b")
    failure = consumer.pull("d", producer.hold("p", [[3]], 4), [[5]], 4)
    assert failure is not None and failure.reason is FailureReason.INCOMPATIBLE
    assert "model_id is 'model-a' there and 'model-b' here" in failure.message


@pytest.mark.parametrize("same_engine_id", [False, True])
def test_a_producer_restarted_on_the_same_port_is_handshaken_again(
    producers, make_consumer, same_engine_id: bool
) -> None:
    engine_id = "prefill-0" if same_engine_id else None
    first = producers(seed=1, engine_id=engine_id)
    consumer = make_consumer()
    assert consumer.pull("d1", first.hold("p1", [[3, 4]], 8), [[5, 6]], 8) is None
    stale = first.hold("p2", [[7, 8]], 8)
    first.kill()

    second = producers(seed=2, port=first.port, engine_id=engine_id)
    assert second.port == first.port and second.agent_name != first.agent_name

    # A request prefilled by the dead process fails cleanly: its blocks are gone.
    failure = consumer.pull("d2", stale, [[9, 10]], 8)
    assert failure is not None and failure.reason is FailureReason.PRODUCER_RESTARTED
    assert not consumer.caches[0][[9, 10]].any()
    # One prefilled by the new process is pulled from it.
    assert consumer.pull("d3", second.hold("p3", [[11, 12]], 8), [[13, 14]], 8) is None
    expected = fill_cache({**SMALL, "seed": 2}, 0)
    assert block_bytes(consumer.caches[0], [13, 14]) == block_bytes(expected, [11, 12])


def test_a_hold_claimed_by_one_consumer_is_refused_to_another(producers, make_consumer) -> None:
    """A decode hop retried on a second pod computes the prompt itself: only the pod whose
    heartbeat claimed the hold reads the blocks, so a late notification of the first pod
    can never free blocks the second is reading."""
    producer = producers()
    first = make_consumer(heartbeat_interval_s=0.1)
    second = make_consumer()
    params = producer.hold("p", [[3, 4, 5]], 12)
    # Queued on the first pod: its heartbeats claim the hold.
    first.scheduler.add_request("d1", params)
    deadline = time.monotonic() + 10
    while producer.call("status")["readers"] != {"p": first.worker.agent_name}:
        assert time.monotonic() < deadline, producer.call("status")
        time.sleep(0.02)

    failure = second.pull("d2", params, [[7, 8, 9]], 12)

    assert failure is not None and failure.reason is FailureReason.LEASE_LOST
    assert not second.caches[0][[7, 8, 9]].any()
    # Its free (sent when it gave up, flushed by shutdown) left the first pod's hold alone.
    second.scheduler.shutdown()
    status = producer.call("status")
    assert (status["blocks_held"], status["ended"]) == (3, [])
    # The first pod pulls as usual, and its notification ends the hold.
    num_external = first.scheduler.get_num_new_matched_tokens(params, prompt(12), 0)
    first.scheduler.update_state_after_alloc("d1", params, [[7, 8, 9]], 0, num_external)
    assert first.wait("d1") is None
    assert block_bytes(first.caches[0], [7, 8, 9]) == block_bytes(fill_cache(SMALL, 0), [3, 4, 5])
    status = producer.wait_ended("p")
    assert (status["stats"]["sends_pulled"], status["stats"]["sends_freed"]) == (1, 0)


def test_a_producer_killed_before_the_pull_fails_it_within_bounded_time(
    producers, make_consumer
) -> None:
    producer = producers()
    consumer = make_consumer(side_channel_timeout_s=2.0, pull_timeout_s=5.0)
    # A first pull caches the handshake, so the second goes straight to the producer.
    assert consumer.pull("d1", producer.hold("p1", [[3]], 4), [[5]], 4) is None
    params = producer.hold("p2", [[6, 7]], 8)
    producer.kill()
    started = time.monotonic()

    failure = consumer.pull("d2", params, [[8, 9]], 8)

    assert time.monotonic() - started < 5.0
    assert failure is not None and failure.reason is FailureReason.PRODUCER_UNREACHABLE
    assert consumer.scheduler.num_pulls_in_flight == 0
    assert not consumer.caches[0][[8, 9]].any()


def test_a_second_block_group_travels_in_the_same_read(producers, make_consumer) -> None:
    producer = producers(num_groups=2, seed=5)
    consumer = make_consumer(num_groups=2)
    # Group 0: the prompt's self-attention blocks; group 1: cross-attention, pulled whole.
    params = producer.hold("p", [[3, 4, 5], [20, 21]], 12)
    assert params.remote_block_ids == ((3, 4, 5), (20, 21))

    assert consumer.pull("d", params, [[6, 7, 8], [30, 40]], 12) is None

    spec = {**SMALL, "seed": 5}
    assert block_bytes(consumer.caches[0], [6, 7, 8]) == block_bytes(fill_cache(spec, 0),
                                                                     [3, 4, 5])
    assert block_bytes(consumer.caches[1], [30, 40]) == block_bytes(fill_cache(spec, 1),
                                                                    [20, 21])
    # One run in group 0, two in group 1, all in one read.
    assert consumer.metrics.snapshot().descriptors == 3
    assert producer.wait_ended("p")["blocks_held"] == 0


def test_a_request_finished_during_its_pull_keeps_its_blocks_until_the_read_is_over(
    producers, make_consumer
) -> None:
    producer = producers()
    consumer = make_consumer()
    params = producer.hold("p", [[3, 4]], 8)
    consumer.start_pull("d", params, [[5, 6]], 8)

    keep, returned = consumer.scheduler.request_finished("d", params, [[5, 6]], prompt(8), 0,
                                                          aborted=True)

    assert keep and returned is None
    deadline = time.monotonic() + 20
    while "d" not in consumer.done.free and time.monotonic() < deadline:
        consumer.step()
    assert consumer.done.free == ["d"] and not consumer.done.ready and not consumer.done.failed
    assert consumer.scheduler.num_pulls_in_flight == 0
    producer.wait_ended("p", timeout=5)


def test_prefix_hits_on_the_consumer_shorten_the_pull(producers, make_consumer) -> None:
    producer = producers(seed=3)
    consumer = make_consumer()
    block = SMALL["block_size"]
    params = producer.hold("p", [[10, 11, 12, 13]], 4 * block)
    # The first two blocks are prefix hits here (local blocks 20, 21 already hold them).
    consumer.scheduler.add_request("d", params)
    num_external = consumer.scheduler.get_num_new_matched_tokens(params, prompt(4 * block),
                                                                 2 * block)
    assert num_external == 2 * block - 1
    consumer.scheduler.update_state_after_alloc("d", params, [[20, 21, 22, 23]], 2 * block,
                                                num_external)

    assert consumer.wait("d") is None

    expected = fill_cache({**SMALL, "seed": 3}, 0)
    assert block_bytes(consumer.caches[0], [22, 23]) == block_bytes(expected, [12, 13])
    assert not consumer.caches[0][[20, 21]].any()
    assert consumer.metrics.snapshot().bytes_pulled == 2 * len(block_bytes(expected, [0]))


def test_a_frozen_producer_fails_the_pull_within_the_side_channel_timeout(
    producers, make_consumer
) -> None:
    producer = producers()
    consumer = make_consumer(side_channel_timeout_s=1.0)
    assert consumer.pull("d1", producer.hold("p1", [[3]], 4), [[5]], 4) is None
    params = producer.hold("p2", [[6]], 4)
    os.kill(producer.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        failure = consumer.pull("d2", params, [[7]], 4)
        assert time.monotonic() - started < 4.0
    finally:
        os.kill(producer.proc.pid, signal.SIGCONT)
    assert failure is not None and failure.reason is FailureReason.PRODUCER_UNREACHABLE
    assert "timed out" in failure.message


def test_params_naming_blocks_not_held_for_the_request_are_refused(producers, make_consumer) -> None:
    """Params naming other blocks cannot make a consumer read another prompt's KV into its
    cache (and from there into its prefix cache): it reads only what the producer holds for
    the request named. Forged params fail their signature first (see test_connector.py);
    these are signed with the key, as a pod's bug or a key holder could."""
    producer = producers()
    consumer = make_consumer()
    producer.hold("other", [[9]], 4)
    for i, forged in enumerate((((9,),), ((64,),), ((3, 9),))):
        params = producer.hold(f"p{i}", [[3 + i]], 4)
        local = [list(range(20, 20 + len(forged[0])))]
        resigned = sign_params(dataclasses.replace(params, remote_block_ids=forged), TEST_KEY,
                               time.time())
        failure = consumer.pull(f"d{i}", resigned, local, 4 * len(forged[0]))

        assert failure is not None and failure.reason is FailureReason.INVALID_PARAMS
        assert f"does not hold for request p{i}" in failure.message
        assert not consumer.caches[0][local[0]].any()
        # The consumer gave its claim on the request up at once.
        producer.wait_ended(f"p{i}")
    # The other request's hold is untouched.
    status = producer.call("status")
    assert status["blocks_held"] == 1 and "other" not in status["ended"]


def test_a_silent_producer_does_not_slow_pulls_from_another(producers, make_consumer) -> None:
    """Sixteen pulls whose (correctly signed) params name a producer that never answers
    take at most two of the consumer's preparation threads; a pull from a live producer
    meanwhile takes no longer than it does alone, plus a second at most."""
    producer = producers()
    consumer = make_consumer(side_channel_timeout_s=1.0, side_channel_connect_timeout_s=1.0)
    assert consumer.pull("warm", producer.hold("p-warm", [[3]], 4), [[5]], 4) is None
    alone = []
    for i in range(3):
        started = time.monotonic()
        params = producer.hold(f"p-alone-{i}", [[4]], 4)
        assert consumer.pull(f"alone-{i}", params, [[6]], 4) is None
        alone.append(time.monotonic() - started)
    silent = SilentListener()
    try:
        held = producer.hold("p-real", [[7]], 4)
        for i in range(16):
            fake = dataclasses.replace(held, remote_port=silent.port, remote_request_id=f"x{i}")
            consumer.start_pull(f"stuck-{i}", sign_params(fake, TEST_KEY, time.time()),
                                [[10 + i]], 4)
        consumer.step()
        time.sleep(0.3)  # the silent producer's calls are under way
        started = time.monotonic()
        assert consumer.pull("real", held, [[40]], 4) is None
        took = time.monotonic() - started
        assert took < sorted(alone)[1] + 1.0, (took, alone)
        assert block_bytes(consumer.caches[0], [40]) == block_bytes(fill_cache(SMALL, 0), [7])
        # Still waiting their turn, two at a time, none failed yet.
        assert not [r for r in consumer.done.failed if r.startswith("stuck-")]
        assert 1 <= silent.most_open <= 2
    finally:
        silent.close()
