"""CUDA graphs of decode steps on a GPU (runner/cuda_graphs.py): outputs with graphs equal
outputs with `enforce_eager`, with and without async scheduling, token for token in
float32 on the Triton backend (greedy, seeded, logprobs, penalties, n > 1, chunked prefill,
preemption); seeded requests sample the same tokens in any batch. They run where CUDA is
(`pytest -m gpu`) and skip elsewhere."""

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


def _llm(path: Path, *, enforce_eager: bool, async_scheduling: bool = False,
         dtype: str = "float32", max_num_seqs: int = 32) -> LLM:
    # 48 blocks of 16 for 28 requests of up to 100 tokens: they preempt each other.
    return LLM(model=str(path), device="cuda", dtype=dtype, attention_backend="triton",
               max_model_len=256, block_size=16, num_gpu_blocks_override=48,
               max_num_batched_tokens=64, max_num_seqs=max_num_seqs,
               enforce_eager=enforce_eager, async_scheduling=async_scheduling)


def _requests(num: int = 28) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=int(n)).tolist() for n in rng.integers(4, 60, size=num)]
    params = []
    for i in range(num):
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=int(rng.integers(8, 40)),
                                         ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=30,
                                         ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=20, logprobs=3,
                                         ignore_eos=True))
        elif kind == 3:
            params.append(SamplingParams(temperature=0.0, max_tokens=25,
                                         repetition_penalty=1.2, ignore_eos=True))
        else:
            params.append(SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=12,
                                         ignore_eos=True))
    return prompts, params


def _count_replays(llm: LLM) -> list[tuple[int, int]]:
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and set(graphs.graphs) == set(graphs.sizes)
    seen: list[tuple[int, int]] = []
    run = graphs.run

    def counted(num_reqs: int, size: int) -> torch.Tensor:
        seen.append((num_reqs, size))
        return run(num_reqs, size)

    graphs.run = counted  # type: ignore[method-assign]
    return seen


def _assert_same(expected: list, got: list) -> None:
    for want, have in zip(expected, got, strict=True):
        for a, b in zip(want.outputs, have.outputs, strict=True):
            assert b.token_ids == a.token_ids, want.request_id
            assert b.finish_reason == a.finish_reason
            if a.logprobs is not None:
                for pos_a, pos_b in zip(a.logprobs, b.logprobs, strict=True):
                    assert sorted(pos_a) == sorted(pos_b)
                    for token, entry in pos_a.items():
                        assert pos_b[token].logprob == pytest.approx(entry.logprob, abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graphs_equal_enforce_eager(make_checkpoint: Callable[..., Path],
                                    async_scheduling: bool) -> None:
    path = make_checkpoint("LlamaForCausalLM", vocab_size=256)
    prompts, params = _requests()
    inputs = [{"prompt_token_ids": p} for p in prompts]
    eager = _llm(path, enforce_eager=True)
    assert eager.llm_engine.runner.graphs is None
    expected = eager.generate(inputs, params, use_tqdm=False)
    del eager
    llm = _llm(path, enforce_eager=False, async_scheduling=async_scheduling)
    replays = _count_replays(llm)
    got = llm.generate(inputs, params, use_tqdm=False)
    _assert_same(expected, got)
    engine = llm.llm_engine
    assert engine.stats.scheduler.num_preemptions > 0
    assert any(rows < size for rows, size in replays)  # padded steps
    assert len({size for _, size in replays}) >= 4
    assert engine.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks - 1


def test_seeded_sampling_is_independent_of_the_batch(make_checkpoint: Callable[..., Path]) -> None:
    """A seeded request samples the same tokens alone (graph of size 1) and among 20
    others (graphs of 24, 16, ...), in bfloat16 with graphs."""
    path = make_checkpoint("LlamaForCausalLM", vocab_size=256)
    rng = np.random.default_rng(3)
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=24,
                            ignore_eos=True)
    prompt = {"prompt_token_ids": rng.integers(3, 256, size=17).tolist()}
    llm = _llm(path, enforce_eager=False, dtype="bfloat16")
    alone = llm.generate([prompt], [seeded], use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": rng.integers(3, 256, size=int(n)).tolist()}
              for n in rng.integers(4, 40, size=20)]
    other_params = [SamplingParams(temperature=0.8, seed=i, max_tokens=int(rng.integers(4, 30)),
                                   ignore_eos=True) for i in range(20)]
    crowd = llm.generate(others[:9] + [prompt] + others[9:], other_params[:9] + [seeded]
                         + other_params[9:], use_tqdm=False)
    assert crowd[9].outputs[0].token_ids == alone
    assert len(set(alone)) > 1
