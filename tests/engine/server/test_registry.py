"""The pod's registry record against a real Redis: refreshed from its own thread, so a pod
whose event loop is blocked for seconds stays registered; a loop wedged past the stall limit
lets it expire; a stopping pod leaves a signed leaving record."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Self

import pytest
import redis
from kvferry.engine.core.messages import SchedulerStats
from kvferry.engine.server import registry
from kvferry.engine.server.registry import PodRegistrar, registration_settings
from kvferry.kvtransfer.auth import TransferKey

from kvferry.protocol.kv_events import KVEventBatch, kv_events_key
from kvferry.protocol.record_auth import check_batch, check_record
from kvferry.protocol.registry import REGISTRY_TTL_S, PodRecord

KEY = TransferKey(b"k" * 32)
SERVICE = "blocked"

Sample = tuple[float, bytes | None]  # (time.monotonic(), the key's value or None)


def registrar(redis_url: str, name: str) -> PodRegistrar:
    settings = registration_settings(redis_url, SERVICE, "decode", "127.0.0.1", 8000, None, KEY)
    return PodRegistrar(replace(settings, pod=name), "m", block_size=16)


class Watcher:
    """Reads the pod's key from another thread every 50 ms while the test's loop blocks."""

    def __init__(self, redis_url: str, key: str) -> None:
        self._store = redis.Redis.from_url(redis_url)
        self._key = key
        self.samples: list[Sample] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch)

    def _watch(self) -> None:
        while not self._done.wait(0.05):
            self.samples.append((time.monotonic(), self._store.get(self._key)))

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()
        self._store.close()


def records(samples: list[Sample], start: float, end: float) -> list[PodRecord | None]:
    return [PodRecord.from_json(raw) if raw is not None else None
            for at, raw in samples if start <= at <= end]


@pytest.fixture
def store(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def test_a_pod_whose_loop_is_blocked_for_5_s_stays_registered(redis_url: str,
                                                             store: redis.Redis) -> None:
    pod = registrar(redis_url, "blocked-5s")

    async def main() -> tuple[float, float]:
        pod.start()
        await asyncio.sleep(0.6)
        pod.record_stats(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1,
                                        stored_block_hashes=[b"h" * 32]), None)
        started = time.monotonic()
        time.sleep(5.0)  # noqa: ASYNC251 (a handler holding the loop: nothing else runs)
        ended = time.monotonic()
        await pod.stop()
        return started, ended

    with Watcher(redis_url, pod.key) as watcher:
        started, ended = asyncio.run(main())
    during = records(watcher.samples, started, ended)
    assert len(during) > 80 and None not in during, during
    for record in during:
        assert record is not None and check_record(record, KEY, time.time()) is None
    # Refreshed all along (every 0.5 s), with the load the loop handed over before it blocked.
    stamps = sorted({r.updated_at for r in during if r is not None})
    assert len(stamps) >= 8 and max(b - a for a, b in itertools.pairwise(stamps)) < 1.5
    assert (during[-1].num_running, during[-1].num_waiting) == (3, 1)  # type: ignore[union-attr]
    # The KV events handed over before the block went out during it.
    events = store.xrange(kv_events_key(SERVICE))
    batches = [KVEventBatch.from_fields(fields) for _, fields in events]
    mine = [b for b in batches if b.pod == "blocked-5s"]
    assert [b.stored for b in mine] == [[], [b"h" * 32]]
    assert all(check_batch(b, KEY) is None for b in mine)


def test_a_stopping_pod_leaves_a_signed_leaving_record_that_expires(
        redis_url: str, store: redis.Redis) -> None:
    pod = registrar(redis_url, "leaving")

    async def main() -> None:
        pod.start()
        await asyncio.sleep(0.3)
        assert not PodRecord.from_json(store.get(pod.key)).is_leaving  # type: ignore[arg-type]
        await pod.stop()

    asyncio.run(main())
    raw = store.get(pod.key)
    assert raw is not None and b"is_leaving" in raw
    record = PodRecord.from_json(raw)
    assert record.is_leaving and check_record(record, KEY, time.time()) is None
    assert 0 < store.pttl(pod.key) <= REGISTRY_TTL_S * 1000
    # Written once, by `stop`: the thread is over and refreshes nothing after it.
    time.sleep(0.6)
    assert store.get(pod.key) == raw


def test_a_loop_wedged_past_the_stall_limit_lets_the_record_expire_until_it_runs_again(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "LOOP_BEAT_S", 0.1)
    monkeypatch.setattr(registry, "LOOP_STALL_LIMIT_S", 0.5)
    pod = registrar(redis_url, "wedged")

    async def main() -> tuple[float, float, float]:
        pod.start()
        await asyncio.sleep(0.3)
        started = time.monotonic()
        time.sleep(0.5 + REGISTRY_TTL_S + 1.0)  # noqa: ASYNC251 (past the limit and the TTL)
        ended = time.monotonic()
        await asyncio.sleep(1.0)  # the loop beats again
        back = time.monotonic()
        await pod.stop()
        return started, ended, back

    with Watcher(redis_url, pod.key) as watcher:
        started, ended, back = asyncio.run(main())
    during = records(watcher.samples, started, ended)
    assert during[0] is not None and during[-1] is None
    # Not refreshed after the limit: the last record is from its first half second or so.
    last = max(r.updated_at for r in during if r is not None)
    assert last < time.time() - REGISTRY_TTL_S - 0.5
    after = records(watcher.samples, back - 0.3, back)
    assert after and all(r is not None and not r.is_leaving for r in after)


def test_an_encoder_decoder_pod_publishes_its_encoder_and_cross_block_events(
        redis_url: str, store: redis.Redis) -> None:
    settings = registration_settings(redis_url, SERVICE, "decode", "127.0.0.1", 8000, None, KEY)
    pod = PodRegistrar(replace(settings, pod="whisper"), "m", block_size=16,
                       encoder_input="audio", max_encoder_len=1500)
    steps = [SchedulerStats(stored_block_hashes=[b"d" * 32], stored_cross_hashes=[b"c" * 32]),
             SchedulerStats(evicted_cross_hashes=[b"c" * 32]),
             SchedulerStats(num_running_reqs=1)]  # no events: no batch

    async def main() -> None:
        pod.start()
        for stats in steps:
            pod.record_stats(stats, None)
        await asyncio.sleep(0.4)
        await pod.stop()

    asyncio.run(main())
    record = PodRecord.from_json(store.get(pod.key))  # type: ignore[arg-type]
    assert (record.encoder_input, record.max_encoder_len) == ("audio", 1500)
    assert check_record(record, KEY, time.time()) is None
    batches = [KVEventBatch.from_fields(fields)
               for _, fields in store.xrange(kv_events_key(SERVICE))]
    mine = [b for b in batches if b.pod == "whisper"]
    assert [(b.stored, b.cross_stored, b.cross_evicted) for b in mine] == [
        ([], [], []), ([b"d" * 32], [b"c" * 32], []), ([], [], [b"c" * 32])]
    assert all(check_batch(b, KEY) is None for b in mine)
