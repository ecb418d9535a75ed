"""Sizing the KV cache: the budget arithmetic, the profiling batch, the profiling step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvferry.engine.config import CacheConfig
from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.runner.memory_profile import (
    gpu_kv_cache_budget,
    profile_batch,
    run_profile_step,
)
from kvferry.engine.runner.model_runner import determine_num_blocks, kv_cache_block_bytes

from kvferry import LLM, SamplingParams

GIB = 1 << 30


def test_the_budget_is_the_granted_share_less_what_is_resident_and_the_activation_peak() -> None:
    # 80 GiB device, 90% granted (72 GiB); 18 GiB resident (weights, context, another
    # process); the largest step peaks 6 GiB above that: 48 GiB for the KV cache.
    assert gpu_kv_cache_budget(80 * GIB, 62 * GIB, 0.9, 6 * GIB) == 48 * GIB
    # Weights and activations beyond the granted share leave a negative budget.
    assert gpu_kv_cache_budget(80 * GIB, 10 * GIB, 0.5, 1 * GIB) == -31 * GIB


def test_blocks_of_a_gpu_budget(make_checkpoint) -> None:
    arch = ModelArchConfig.from_pretrained(make_checkpoint())
    cache = CacheConfig(block_size=16)
    block = kv_cache_block_bytes(arch, 16, torch.bfloat16)
    # 2 layers x (K, V) x 16 tokens x 2 kv heads x 16 dims x 2 bytes
    assert block == 2 * 2 * 16 * 2 * 16 * 2
    assert determine_num_blocks(arch, cache, torch.bfloat16, 100 * block + block // 2) == 100
    with pytest.raises(ValueError, match="holds 0 blocks of 16 tokens; at least 2 are needed"):
        determine_num_blocks(arch, cache, torch.bfloat16, -GIB)


def test_the_profiling_batch_splits_tokens_into_max_length_prefills() -> None:
    # 10 tokens, max_model_len 4, block size 2: requests of 4, 4 and 2 tokens on blocks
    # [1, 2], [3, 4], [5, 6]; request 2's tokens 0 and 1 sit in block 5 at slots 10, 11.
    metadata, positions, num_blocks = profile_batch(10, 4, 2, torch.device("cpu"))
    assert metadata.seq_lens_np.tolist() == [4, 4, 2]
    assert metadata.query_start_loc_np.tolist() == [0, 4, 8, 10]
    assert metadata.block_table.tolist() == [[1, 2], [3, 4], [5, 6]]
    assert positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert metadata.slot_mapping.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert num_blocks == 7
    assert metadata.num_actual_tokens == 10 and metadata.max_query_len == 4


def test_the_profiling_step_runs_the_model_and_sampler_and_changes_nothing(make_checkpoint) -> None:
    llm = LLM(model=str(make_checkpoint()), max_model_len=64, block_size=8,
              num_gpu_blocks_override=40, seed=0)
    prompts = [{"prompt_token_ids": np.arange(5, 25).tolist()}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.llm_engine.engine_core.runner
    cache = runner.kv_cache.clone()
    run_profile_step(runner.model, runner.arch.vocab_size, num_tokens=150, max_num_seqs=16,
                     max_model_len=64, block_size=8, kv_cache_shape=runner.kv_cache_shape(1),
                     dtype=runner.dtype, device=runner.device)
    assert torch.equal(runner.kv_cache, cache)  # it wrote only its own temporary cache
    after = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before
    assert runner.measure_kv_cache_budget(0.9, 16) is None  # CPU: the budget is configured
