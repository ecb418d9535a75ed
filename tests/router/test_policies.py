"""Routing policies and the prefix index, on pods built from small records."""

from __future__ import annotations

from kvferry.router.pods import Pod
from kvferry.router.policies import LeastLoaded, PrefixAware, RoundRobin
from kvferry.router.prefix_index import PrefixIndex, prompt_block_hashes

from kvferry.protocol.block_hash import ROOT_HASH, hash_block_tokens
from kvferry.protocol.registry import PodRecord


def pod(name: str, waiting: int = 0, running: int = 0, kv: float = 0.0, routed: int = 0) -> Pod:
    record = PodRecord(pod=name, service="s", role="decode", model="m",
                       url=f"http://{name}", block_size=4, num_running=running,
                       num_waiting=waiting, kv_cache_usage=kv, updated_at=0.0)
    return Pod(record, num_routed=routed)


def test_prompt_hashes_are_the_engines_chained_block_hashes() -> None:
    tokens = list(range(10))  # two full blocks of 4, two tokens left over
    first = hash_block_tokens(ROOT_HASH, tokens[:4])
    assert prompt_block_hashes(tokens, 4) == [first, hash_block_tokens(first, tokens[4:8])]


def test_round_robin_cycles_by_name() -> None:
    pods = [pod("b"), pod("a"), pod("c")]
    policy = RoundRobin()
    assert [policy.choose(pods, None).pod.name for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_loaded_orders_by_waiting_then_kv_usage() -> None:
    pods = [pod("a", waiting=1), pod("b", kv=0.9), pod("c", kv=0.2)]
    assert LeastLoaded().choose(pods, None).pod.name == "c"
    assert LeastLoaded().choose(pods[:2], None).pod.name == "b"


def test_prefix_aware_counts_only_leading_blocks() -> None:
    index = PrefixIndex()
    hashes = prompt_block_hashes(list(range(16)), 4)
    index.stored("a", hashes[:3])
    index.stored("b", hashes[1:])  # holds later blocks but not the first: no match at all
    assert index.num_leading_blocks(hashes, ["a", "b", "c"]) == {"a": 3, "b": 0, "c": 0}
    index.evicted("a", hashes[1:2])
    assert index.num_leading_blocks(hashes, ["a"]) == {"a": 1}


def test_prefix_aware_picks_the_holder_and_predicts_its_hit_tokens() -> None:
    index = PrefixIndex()
    hashes = prompt_block_hashes(list(range(40)), 4)
    index.stored("b", hashes)
    choice = PrefixAware(index).choose([pod("a"), pod("b"), pod("c")], hashes)
    assert (choice.pod.name, choice.predicted_hit_tokens) == ("b", 40)


def test_prefix_aware_stops_sending_to_a_holder_under_skew() -> None:
    index = PrefixIndex()
    hashes = prompt_block_hashes(list(range(40)), 4)  # 10 blocks held by b
    index.stored("b", hashes)
    assert PrefixAware(index).choose([pod("a"), pod("b", waiting=3)], hashes).pod.name == "b"
    # Four queued requests cost more than a whole-prompt hit is worth...
    assert PrefixAware(index).choose([pod("a"), pod("b", waiting=4)], hashes).pod.name == "a"
    # ... and so do five requests the router has in flight on it.
    assert PrefixAware(index).choose([pod("a"), pod("b", routed=5)], hashes).pod.name == "a"


def test_prefix_aware_without_a_prompt_is_least_loaded() -> None:
    assert PrefixAware(PrefixIndex()).choose([pod("a", waiting=1), pod("b")], None).pod.name == "b"
