"""The router trusts only what the service's pods wrote to Redis: records and KV event
batches that do not verify with the service's key get no traffic and no say in routing, and
records whose values no pod publishes are ignored with a key or without (real Redis, real
fake-engine pods that sign with the key, real router processes)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import redis
from kvferry.kvtransfer.auth import KEY_ENV, TransferKey
from kvferry_testing.procs import Proc, fake_engine, router_process

from kvferry.protocol.block_hash import hash_request_blocks
from kvferry.protocol.kv_events import KVEventBatch, kv_events_key
from kvferry.protocol.record_auth import sign_batch, sign_record
from kvferry.protocol.registry import PodRecord, pod_key_prefix

SERVICE = "trust"
KEY = TransferKey(b"the-trust-services-kv-transfer-key-0123456789")
OTHER_KEY = TransferKey(b"a-key-that-is-not-the-services-one-0123456789")
BLOCK_SIZE = 16  # the fake pods' KV block size
NUM_REQUESTS = 6


def url(proc: Proc) -> str:
    return f"http://127.0.0.1:{proc.port}"  # type: ignore[attr-defined]


def metric(router: Proc, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(url(router) + "/metrics").text.splitlines():
        if line.startswith((name + "{", name + " ")):
            sample, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in sample for k, v in labels.items()):
                total += float(value)
    return total


def rejected(router: Proc, reason: str) -> float:
    return metric(router, "kvferry:router_registry_rejected_total", reason=reason)


def wait_for(what: str, condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def num_received(pod: Proc) -> int:
    return len(httpx.get(url(pod) + "/fake/requests").json())


def complete(router: Proc, prompt: object) -> None:
    client = openai.OpenAI(base_url=url(router) + "/v1", api_key="none", max_retries=0,
                           timeout=10)
    out = client.completions.create(model="fake", prompt=prompt, max_tokens=3)  # type: ignore[arg-type]
    assert out.choices[0].text == " a b c"


def record(name: str, target: Proc, **changes: object) -> PodRecord:
    """A decode record as a pod of the service would publish it, sending to `target`."""
    fields: dict[str, object] = {
        "pod": name, "service": SERVICE, "role": "decode", "model": "fake", "url": url(target),
        "block_size": BLOCK_SIZE, "num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0,
        "updated_at": time.time()}
    return PodRecord(**{**fields, **changes})  # type: ignore[arg-type]


@dataclass
class Service:
    """Two keyed decode pods behind a keyed and an unkeyed router, and an attacker's pod."""

    redis: redis.Redis
    pods: dict[str, Proc]
    evil: Proc  # answers like a pod, but is no pod of the service
    keyed: Proc  # the router with the service's key
    unkeyed: Proc  # a router without one (an insecure setup)

    def set_record(self, name: str, value: PodRecord | str) -> None:
        """SET without a TTL, as the attacker does."""
        raw = value if isinstance(value, str) else value.to_json()
        self.redis.set(pod_key_prefix(SERVICE) + name, raw)

    def delete_record(self, name: str) -> None:
        self.redis.delete(pod_key_prefix(SERVICE) + name)


def live_pods(router: Proc) -> dict[str, list[str]]:
    return httpx.get(url(router) + "/health").json()["pools"]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("trust")
    procs: dict[str, Proc] = {}
    try:
        for name in ("pod-a", "pod-b"):
            procs[name] = fake_engine(tmp, redis_url, SERVICE, "decode", name,
                                      env={KEY_ENV: KEY.text})
        # Registered in another service: it only answers at the address the forged records
        # name, and counts what it is sent.
        procs["evil"] = fake_engine(tmp, redis_url, "elsewhere", "decode", "evil")
        # Prefix-aware decode: pod-a (first by name) wins every tie, so a prompt goes to
        # pod-b only when the prefix index says pod-b holds it.
        routing = {"KVFERRY_ROUTING_DECODE": "prefix-aware"}
        for folder in ("keyed", "unkeyed"):  # each router logs to router.log in its own
            (tmp / folder).mkdir()
        procs["keyed"] = router_process(tmp / "keyed", redis_url, SERVICE,
                                        env={**routing, KEY_ENV: KEY.text})
        procs["unkeyed"] = router_process(tmp / "unkeyed", redis_url, SERVICE,
                                          env={**routing, KEY_ENV: ""})
        for router in (procs["keyed"], procs["unkeyed"]):
            wait_for("both pods", lambda r=router: live_pods(r) == {"decode": ["pod-a", "pod-b"]})
        yield Service(redis.Redis.from_url(redis_url), {n: procs[n] for n in ("pod-a", "pod-b")},
                      procs["evil"], procs["keyed"], procs["unkeyed"])
    finally:
        for proc in procs.values():
            proc.stop()


def test_the_routers_warn_about_a_missing_key_only_when_it_is_missing(service: Service) -> None:
    warning = "no KV transfer key: the router takes any pod record"
    assert warning in service.unkeyed.log()
    assert warning not in service.keyed.log()
    assert KEY.text not in service.keyed.log()


def settle(service: Service, unkeyed_view: dict[str, list[str]]) -> None:
    """Until both routers have reread the registry: the unkeyed one shows `unkeyed_view`,
    and the keyed one, polling as often, has had two more polls."""
    wait_for("the unkeyed router's view", lambda: live_pods(service.unkeyed) == unkeyed_view)
    time.sleep(0.6)


def test_an_attackers_record_with_a_negative_queue_gets_no_traffic(service: Service) -> None:
    served_before = sum(num_received(p) for p in service.pods.values())
    evil_before = num_received(service.evil)
    # The attack: an always-least-loaded record, no MAC, no TTL.
    service.set_record("evil", record("evil", service.evil, num_waiting=-1000))
    # A pod signed with another service's key, in range: an insecure router takes it.
    service.set_record("stranger", sign_record(record("stranger", service.evil), OTHER_KEY))
    try:
        settle(service, {"decode": ["pod-a", "pod-b", "stranger"]})
        for i in range(NUM_REQUESTS):
            complete(service.keyed, f"hello {i}")
        assert num_received(service.evil) == evil_before
        assert sum(num_received(p) for p in service.pods.values()) == \
            served_before + NUM_REQUESTS
        assert live_pods(service.keyed) == {"decode": ["pod-a", "pod-b"]}
        # The negative queue is out of range before anything else; each value is counted
        # once though the routers reread it at every poll.
        assert (rejected(service.keyed, "out_of_range"),
                rejected(service.keyed, "bad_signature")) == (1, 1)
        # Without a key the negative queue is refused all the same.
        assert rejected(service.unkeyed, "out_of_range") == 1
    finally:
        service.delete_record("evil")
        service.delete_record("stranger")


def test_an_in_range_record_without_a_mac_gets_no_traffic(service: Service) -> None:
    evil_before = num_received(service.evil)
    unsigned_before = rejected(service.keyed, "unsigned")
    service.set_record("evil", record("evil", service.evil))
    try:
        settle(service, {"decode": ["evil", "pod-a", "pod-b"]})
        for i in range(NUM_REQUESTS):
            complete(service.keyed, f"again {i}")
        assert num_received(service.evil) == evil_before
        assert live_pods(service.keyed) == {"decode": ["pod-a", "pod-b"]}
        assert rejected(service.keyed, "unsigned") == unsigned_before + 1
    finally:
        service.delete_record("evil")
        # The unkeyed router has it as a pod until it is gone.
        wait_for("the record's removal",
                 lambda: live_pods(service.unkeyed) == {"decode": ["pod-a", "pod-b"]})


@pytest.mark.parametrize("changes", [
    {"kv_cache_usage": 1.5}, {"num_running": -1}, {"block_size": 0},
    {"url": "file:///etc/passwd"}, {"updated_at": time.time() + 3600},
], ids=["usage", "running", "block_size", "url", "future"])
def test_a_signed_record_out_of_range_is_ignored_and_counted(
        service: Service, changes: dict[str, object]) -> None:
    """Signed with the service's key (a keyed pod gone wrong), yet out of range."""
    before = rejected(service.keyed, "out_of_range")
    service.set_record("broken", sign_record(record("broken", service.evil, **changes), KEY))
    try:
        wait_for("the rejection", lambda: rejected(service.keyed, "out_of_range") == before + 1)
        assert live_pods(service.keyed) == {"decode": ["pod-a", "pod-b"]}
    finally:
        service.delete_record("broken")


def test_a_signed_record_under_another_pods_key_is_ignored(service: Service) -> None:
    before = rejected(service.keyed, "malformed")
    service.set_record("copy", sign_record(record("pod-a", service.evil), KEY))
    service.set_record("junk", json.dumps([1, 2]))
    try:
        wait_for("both rejections", lambda: rejected(service.keyed, "malformed") == before + 2)
        assert live_pods(service.keyed) == {"decode": ["pod-a", "pod-b"]}
    finally:
        service.delete_record("copy")
        service.delete_record("junk")


def applied_batches(router: Proc) -> float:
    return metric(router, "kvferry:router_kv_event_batches")


def pods_sent(service: Service, prompt: list[int]) -> list[str]:
    return [name for name, pod in service.pods.items()
            if any(body.get("prompt") == prompt
                   for body in httpx.get(url(pod) + "/fake/requests").json())]


def test_a_forged_kv_event_batch_does_not_enter_the_prefix_index(service: Service) -> None:
    held = list(range(5000, 5000 + 4 * BLOCK_SIZE))
    hashes = hash_request_blocks(held, BLOCK_SIZE, [])
    # pod-b "holds" the prompt, says a batch without a MAC, and one with another key's.
    forged = KVEventBatch("pod-b", b"forged-instance", [], hashes)
    before = (applied_batches(service.keyed), rejected(service.keyed, "unsigned"),
              rejected(service.keyed, "bad_signature"),
              metric(service.keyed, "kvferry:router_predicted_prefix_hit_tokens_total"))
    unkeyed_before = applied_batches(service.unkeyed)
    service.redis.xadd(kv_events_key(SERVICE), forged.to_fields())  # type: ignore[arg-type]
    service.redis.xadd(kv_events_key(SERVICE),
                       sign_batch(forged, OTHER_KEY).to_fields())  # type: ignore[arg-type]
    # The unkeyed router applies both (the insecure setup): pod-b holds the prompt for it.
    wait_for("the unkeyed router", lambda: applied_batches(service.unkeyed) == unkeyed_before + 2)
    prompt = held + [1, 2, 3]
    complete(service.unkeyed, prompt)
    assert pods_sent(service, prompt) == ["pod-b"]
    # The keyed router reads the stream as fast; it sends the prompt by the tie-break.
    time.sleep(0.3)
    complete(service.keyed, prompt)
    assert pods_sent(service, prompt) == ["pod-a", "pod-b"]
    assert metric(service.keyed, "kvferry:router_predicted_prefix_hit_tokens_total") == before[3]
    assert applied_batches(service.keyed) == before[0]
    assert (rejected(service.keyed, "unsigned"), rejected(service.keyed, "bad_signature")) \
        == (before[1] + 1, before[2] + 1)


def test_a_genuine_kv_event_batch_is_applied(service: Service) -> None:
    """The pods' own, signed batches still steer the keyed router."""
    held = list(range(7000, 7000 + 3 * BLOCK_SIZE))
    before = applied_batches(service.keyed)
    httpx.post(url(service.pods["pod-b"]) + "/fake/cache",
               json={"token_ids": held}).raise_for_status()
    wait_for("the batch", lambda: applied_batches(service.keyed) == before + 1)
    prompt = held + [4, 5]
    complete(service.keyed, prompt)
    assert pods_sent(service, prompt) == ["pod-b"]
