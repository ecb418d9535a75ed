"""Async scheduling on a GPU: outputs equal the synchronous loop's, token for token.

On CUDA the sampled ids of step N stay on the device and step N+1's inputs are filled from
them there, while the host copy is read one step later (runner/async_output.py); these
check that it computes what the synchronous loop computes, on both attention backends, in
float32 (greedy and seeded sampling, logprobs, penalties, stop strings, n > 1, chunked
prefill and preemption). They run where CUDA is (`pytest -m gpu`) and skip elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvferry import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)"),
]


def _llm(path: Path, backend: str, async_scheduling: bool) -> LLM:
    # 40 blocks of 16 for 24 requests of up to 90 tokens: they preempt each other.
    return LLM(model=str(path), device="cuda", dtype="float32", attention_backend=backend,
               max_model_len=256, block_size=16, num_gpu_blocks_override=40,
               max_num_batched_tokens=64, async_scheduling=async_scheduling)


def _requests() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=int(n)).tolist() for n in rng.integers(4, 60, size=24)]
    params = []
    for i in range(24):
        kind = i % 6
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=30,
                                         ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=20, logprobs=3,
                                         ignore_eos=True))
        elif kind == 3:
            params.append(SamplingParams(temperature=0.0, max_tokens=25,
                                         repetition_penalty=1.2, ignore_eos=True))
        elif kind == 4:
            params.append(SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=12,
                                         ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    return prompts, params


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_async_scheduling_on_cuda_equals_the_synchronous_loop(
    make_checkpoint: Callable[..., Path], backend: str,
) -> None:
    path = make_checkpoint("LlamaForCausalLM", vocab_size=256)
    prompts, params = _requests()
    results = {}
    for async_scheduling in (False, True):
        llm = _llm(path, backend, async_scheduling)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        results[async_scheduling] = outputs
        engine = llm.llm_engine
        assert engine.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks - 1
        if async_scheduling:
            assert engine.stats.scheduler.num_preemptions > 0
            assert not engine.runner.pending
    for sync, overlapped in zip(results[False], results[True]):
        for a, b in zip(sync.outputs, overlapped.outputs, strict=True):
            assert b.token_ids == a.token_ids, sync.request_id
            assert b.finish_reason == a.finish_reason
            if a.logprobs is not None:
                for pos_a, pos_b in zip(a.logprobs, b.logprobs, strict=True):
                    assert sorted(pos_a) == sorted(pos_b)
                    for token, entry in pos_a.items():
                        assert pos_b[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
