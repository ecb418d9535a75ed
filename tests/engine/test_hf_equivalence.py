"""Greedy output equals HF transformers `generate`, token for token, in every scheduling regime.

Each regime runs a batch of 16+ prompts of varied lengths through the whole engine
(scheduler, KV cache, runner, torch attention, sampler) on random float32 weights, and
checks afterwards that every KV block went back to the pool. Seeded sampling is checked
against itself (the same seed gives the same tokens in any batch) and against HF's top-k.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from kvferry import LLM, SamplingParams

ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
NUM_PROMPTS = 16
VOCAB_SIZE = 256
# Seeded sampling keeps the TOP_K most likely tokens at each step.
TOP_K = 20


def _checkpoint(make_checkpoint, architecture: str) -> Path:
    if architecture == "LlamaForCausalLM":
        # Also covers llama3 rope scaling.
        return make_checkpoint(architecture, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        })
    return make_checkpoint(architecture)


def _random_prompts(seed: int, lengths: list[int], prefix: list[int] | None = None) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = prefix or []
    return [prefix + rng.integers(3, VOCAB_SIZE, size=n).tolist() for n in lengths]


def _varied_lengths(seed: int, low: int = 1, high: int = 120) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(low, high, size=NUM_PROMPTS).tolist()
    return lengths


class HFReference:
    """Greedy continuations from HF `generate` on the same weights, EOS disabled."""

    def __init__(self, hf_model, path: Path) -> None:
        self.model = hf_model(path)
        self.config = copy.deepcopy(self.model.generation_config)
        self.config.eos_token_id = []  # [] (not None, which falls back to the model config)
        self.config.do_sample = False
        self.config.pad_token_id = 0
        self._cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self._cache:
            config = copy.deepcopy(self.config)
            config.max_new_tokens = max_tokens
            with torch.no_grad():
                out = self.model.generate(torch.tensor([prompt]), generation_config=config)
            self._cache[key] = out[0, len(prompt):].tolist()
        return self._cache[key]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def setup(request, make_checkpoint, hf_model):
    path = _checkpoint(make_checkpoint, request.param)
    return path, HFReference(hf_model, path)


def _make_llm(path: Path, **overrides) -> LLM:
    kwargs = dict(max_model_len=256, block_size=16, num_gpu_blocks_override=200, seed=0)
    kwargs.update(overrides)
    return LLM(model=str(path), **kwargs)


def _greedy_params(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def _assert_matches_hf(llm: LLM, ref: HFReference, prompts, max_tokens: list[int]) -> list:
    params = [_greedy_params(m) for m in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outputs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == ref.greedy(prompt, m)
        assert out.outputs[0].finish_reason == "length"
    return outputs


def _assert_no_leaked_blocks(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks - 1


def test_chunked_prefill_small_token_budget(setup) -> None:
    path, ref = setup
    llm = _make_llm(path, max_num_batched_tokens=24, max_num_seqs=8)
    prompts = _random_prompts(1, _varied_lengths(1, 20, 120))
    max_tokens = np.random.default_rng(2).integers(4, 12, size=NUM_PROMPTS).tolist()
    _assert_matches_hf(llm, ref, prompts, max_tokens)
    # Every prompt longer than the budget was split across steps.
    assert llm.llm_engine.stats.num_steps > sum(len(p) for p in prompts) // 24
    _assert_no_leaked_blocks(llm)


def test_prefix_cache_hits_from_shared_prefixes(setup) -> None:
    path, ref = setup
    llm = _make_llm(path, enable_prefix_caching=True, max_num_seqs=4)
    shared = np.random.default_rng(3).integers(3, VOCAB_SIZE, size=37).tolist()
    prompts = _random_prompts(4, _varied_lengths(4, 1, 40), prefix=shared)
    max_tokens = [6] * NUM_PROMPTS
    outputs = _assert_matches_hf(llm, ref, prompts, max_tokens)
    stats = llm.llm_engine.stats.scheduler
    # Two full blocks (32 tokens) of the shared prefix are reused by every later request.
    assert stats.prefix_cache_hits >= 32 * (NUM_PROMPTS - 4)
    assert sum(o.num_cached_tokens >= 32 for o in outputs) >= NUM_PROMPTS - 4
    # A second round finds the whole prompts (all full blocks) in the cache.
    again = _assert_matches_hf(llm, ref, prompts, max_tokens)
    for prompt, out in zip(prompts, again):
        assert out.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    _assert_no_leaked_blocks(llm)


def test_preemption_with_small_block_pool(setup) -> None:
    path, ref = setup
    llm = _make_llm(path, num_gpu_blocks_override=24, max_num_batched_tokens=256)
    prompts = _random_prompts(5, _varied_lengths(5, 20, 100))
    max_tokens = np.random.default_rng(6).integers(8, 24, size=NUM_PROMPTS).tolist()
    _assert_matches_hf(llm, ref, prompts, max_tokens)
    assert llm.llm_engine.stats.scheduler.num_preemptions > 0
    _assert_no_leaked_blocks(llm)


def _seeded_params(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(
        temperature=0.8, top_p=0.9, top_k=TOP_K, max_tokens=8, ignore_eos=True, n=n, seed=seed
    )


def _token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def _assert_in_hf_top_k(ref: HFReference, prompt: list[int], tokens: list[int]) -> None:
    """Each sampled token is among HF's TOP_K most likely at its position."""
    with torch.no_grad():
        logits = ref.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    kth_largest = torch.topk(logits, TOP_K).values[:, -1]  # (num_tokens,)
    sampled = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    # The engine's logits agree with HF's to ~1e-5; the margin covers a near tie at rank k.
    assert bool((sampled >= kth_largest - 1e-4).all()), (tokens, sampled, kth_largest)


def test_n_2_seeded_sampling_is_reproducible_and_shares_prompt_blocks(setup) -> None:
    path, ref = setup
    llm = _make_llm(path)
    prompts = _random_prompts(7, _varied_lengths(7, 17, 90))
    # Request i's completions get seeds 100 + i and 101 + i.
    params = [_seeded_params(100 + i, n=2) for i in range(NUM_PROMPTS)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = _token_ids(outputs)
    for prompt, out, (first, second) in zip(prompts, outputs, tokens):
        assert [c.index for c in out.outputs] == [0, 1]
        assert len(first) == len(second) == 8
        assert first != second  # different seeds
        _assert_in_hf_top_k(ref, prompt, first)
        _assert_in_hf_top_k(ref, prompt, second)
    # The second copy of each prompt reused the first copy's full prompt blocks.
    stats = llm.llm_engine.stats.scheduler
    assert stats.prefix_cache_hits >= sum((len(p) - 1) // 16 * 16 for p in prompts)

    # Same seeds in another batch: reversed, interleaved with unseeded sampling requests
    # (which draw from the shared generator), in a fresh engine.
    other = _make_llm(path)
    unseeded = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    mixed_prompts, mixed_params = [], []
    for prompt, p in zip(reversed(prompts), reversed(params)):
        mixed_prompts += [{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[:7]}]
        mixed_params += [p, unseeded]
    mixed = other.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert _token_ids(mixed[::2]) == tokens[::-1]
    # Alone, one completion at a time: child i of a seed-s request is a seed s + i request.
    alone = [_seeded_params(103), _seeded_params(104)]
    assert _token_ids(llm.generate([{"prompt_token_ids": prompts[3]}] * 2, alone,
                                   use_tqdm=False)) == [[tokens[3][0]], [tokens[3][1]]]
    # A different seed samples differently.
    again = llm.generate([{"prompt_token_ids": prompts[3]}], _seeded_params(999), use_tqdm=False)
    assert _token_ids(again) != [[tokens[3][0]]]
    _assert_no_leaked_blocks(llm)
    _assert_no_leaked_blocks(other)
