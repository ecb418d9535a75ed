"""KV transfer between parallel engines on CPU (real worker processes, gloo, real NIXL, all
engines in this process): a prefill engine and a decode engine of the same pipeline- or
tensor-parallel size disaggregate, rank by rank, and the decode's answer equals a
single-process engine's; engines of other parallel sizes refuse each other at the
handshake, naming the difference, and the decode computes the prompt itself."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvferry.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvferry.engine.frontend.llm_engine import LLMEngine
from kvferry.engine.sampling_params import SamplingParams
from kvferry.kvtransfer.config import KVTransferConfig
from kvferry.kvtransfer.metrics import FailureReason
from kvferry_testing.engine_runs import drain, run_one
from kvferry_testing.nixl_probe import read_rank_blocks

from kvferry.protocol.block_hash import hash_request_blocks

BLOCK_SIZE = 4
NUM_BLOCKS = 48
# 29 tokens: 7 whole blocks, the last one past them.
PROMPT = {"prompt_token_ids": [5 + 7 * i % 230 for i in range(29)]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_engine(model: Path, role: str | None, pp: int = 1, tp: int = 1) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(model), max_model_len=64),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16),
        device="cpu",
        parallel=ParallelConfig(pipeline_parallel_size=pp, tensor_parallel_size=tp),
        kv_transfer=None if role is None else KVTransferConfig(
            model_id="parallel-test", insecure=True, role=role, lease_s=10.0),
    ))


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    # 3 layers (uneven stages), 4 query heads over 2 kv heads (one per tensor rank).
    return make_checkpoint(num_layers=3, vocab_size=250)


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[int]:
    single = make_engine(checkpoint, None)
    try:
        return list(run_one(single, "r", PROMPT, GREEDY).outputs[0].token_ids)
    finally:
        single.shutdown()


@pytest.fixture
def engines(checkpoint: Path) -> Iterator[Callable[..., LLMEngine]]:
    made: list[LLMEngine] = []

    def make(role: str, pp: int = 1, tp: int = 1) -> LLMEngine:
        made.append(make_engine(checkpoint, role, pp, tp))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown()


def rank_blocks(engine: LLMEngine, block_ids: list[int]) -> list[list[bytes]]:
    """Per rank of the engine, the bytes of each block, read from its worker's agent."""
    endpoint = engine.engine_core.kv_connector.worker.endpoint  # type: ignore[union-attr]
    return read_rank_blocks(endpoint.host, endpoint.port, block_ids)


def prompt_blocks(engine: LLMEngine, num_blocks: int) -> list[int]:
    """The engine's prefix-cached blocks of the prompt's first `num_blocks` blocks."""
    pool = engine.engine_core.kv_cache_manager.block_pool
    hashes = hash_request_blocks(PROMPT["prompt_token_ids"], BLOCK_SIZE, [])[:num_blocks]
    return [pool.cached_blocks[h].block_id for h in hashes]


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (1, 2)], ids=["pp2", "tp2"])
def test_parallel_prefill_and_decode_engines_disaggregate_rank_by_rank(
        engines: Callable[..., LLMEngine], expected: list[int], pp: int, tp: int) -> None:
    prefill, decode = engines("prefill", pp, tp), engines("decode", pp, tp)
    held: dict[str, Any] = run_one(prefill, "p", PROMPT, GREEDY,
                                   kv_transfer_params={"do_remote_decode": True}
                                   ).kv_transfer_params
    remote_blocks = held["remote_block_ids"]  # one group: a flat list, as vLLM sends it
    assert len(remote_blocks) == 8  # the prompt's 29 tokens and the sampled one

    answer = run_one(decode, "d", PROMPT, GREEDY, kv_transfer_params=held)

    assert list(answer.outputs[0].token_ids) == expected
    stats = decode.engine_core.make_stats().kv_transfer
    assert stats.failures == {} and stats.pulls_finished == 1
    # All but the prompt's last token came over: 7 blocks from each of the ranks.
    theirs = rank_blocks(prefill, remote_blocks[:7])
    assert len(theirs) == pp * tp
    assert stats.bytes_pulled == 7 * sum(len(blocks[0]) for blocks in theirs)
    # Every rank's blocks equal the producer's same rank's, byte for byte, and the ranks
    # hold different parts of the model.
    ours = rank_blocks(decode, prompt_blocks(decode, 7))
    assert ours == theirs
    assert ours[0] != ours[1]
    # The hold ended when every rank's read had notified the producer's same rank.
    drain(prefill, timeout_s=5.0)
    held_stats = prefill.engine_core.make_stats().kv_transfer
    assert (held_stats.sends_pulled, held_stats.lease_expirations) == (1, 0)
    drain(decode)


def test_engines_of_other_parallel_sizes_refuse_each_other_at_the_handshake(
        engines: Callable[..., LLMEngine], expected: list[int],
        caplog: pytest.LogCaptureFixture) -> None:
    prefill = engines("prefill", 2, 1)
    held = run_one(prefill, "p", PROMPT, GREEDY,
                   kv_transfer_params={"do_remote_decode": True}).kv_transfer_params
    decode = engines("decode", 1, 2)

    answer = run_one(decode, "d", PROMPT, GREEDY, kv_transfer_params=held)

    # Refused before any byte moved; `recompute` computed the prompt here.
    assert list(answer.outputs[0].token_ids) == expected
    stats = decode.engine_core.make_stats().kv_transfer
    assert stats.failures == {FailureReason.INCOMPATIBLE.value: 1}
    assert stats.bytes_pulled == 0
    assert "is incompatible: pipeline_parallel_size is 2 there and 1 here" in caplog.text
    drain(prefill)
    drain(decode)
