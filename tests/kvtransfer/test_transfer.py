"""Pulls between a producer process and a consumer, over real NIXL on loopback."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
import torch

from kvferry.kvtransfer import FailureReason
from kvferry.kvtransfer.layout import block_runs

from kvt_harness import SMALL, Consumer, Producer, block_bytes
from kvt_producer import fill_cache


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


def test_consecutive_blocks_move_with_one_descriptor(producers, make_consumer) -> None:
    producer = producers()
    consumer = make_consumer()
    params = producer.hold("p", [list(range(10, 30))], 20 * SMALL["block_size"])

    assert consumer.pull("d", params, [list(range(40, 60))], 20 * SMALL["block_size"]) is None

    assert consumer.metrics.snapshot().descriptors == 1
    expected = fill_cache(SMALL, 0)
    assert block_bytes(consumer.caches[0], list(range(40, 60))) == block_bytes(
        expected, list(range(10, 30)))
