"""Llama-family models against HF transformers on the same random weights (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvferry.engine.attention.torch_backend import TorchAttentionBackend
from kvferry.engine.models.loader import load_model

PROMPT_LENS = [7, 1, 13, 4]
ATOL = 1e-4

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small enough that all three frequency bands occur at head_size 16.
    "original_max_position_embeddings": 64,
}

CASES = {
    "llama": dict(architecture="LlamaForCausalLM"),
    "llama3-rope": dict(architecture="LlamaForCausalLM", rope_scaling=LLAMA3_SCALING),
    "llama-mqa": dict(architecture="LlamaForCausalLM", num_kv_heads=1),
    "llama-tied": dict(architecture="LlamaForCausalLM", tie_word_embeddings=True),
    "llama-sharded": dict(architecture="LlamaForCausalLM", sharded=True),
    "qwen2": dict(architecture="Qwen2ForCausalLM"),
    "qwen3": dict(architecture="Qwen3ForCausalLM", head_dim=32),
    "qwen3-tied-mqa": dict(
        architecture="Qwen3ForCausalLM", num_kv_heads=1, tie_word_embeddings=True
    ),
}


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _load(path: Path) -> torch.nn.Module:
    return load_model(path, torch.float32, TorchAttentionBackend(), torch.device("cpu"))


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_then_decode_match_hf(case, make_checkpoint, hf_logits, paged_run):
    path = make_checkpoint(**CASES[case])
    model = _load(path)
    prompts = _prompts(model.config.vocab_size)
    run = paged_run(model, num_reqs=len(prompts), max_len=max(PROMPT_LENS) + 2)

    prefill = run.step(prompts)
    for prompt, logits in zip(prompts, prefill):
        torch.testing.assert_close(logits, hf_logits(path, prompt), atol=ATOL, rtol=0)

    next_tokens = [[int(logits[-1].argmax())] for logits in prefill]
    decode = run.step(next_tokens)
    for prompt, token, logits in zip(prompts, next_tokens, decode):
        expected = hf_logits(path, prompt + token)[-1:]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_mixed_prefill_and_decode_batch(make_checkpoint, hf_logits, paged_run):
    """Requests at different stages share one step: a chunked prefill beside decodes."""
    path = make_checkpoint()
    model = _load(path)
    prompts = _prompts(model.config.vocab_size, seed=1)
    run = paged_run(model, num_reqs=len(prompts), max_len=max(PROMPT_LENS) + 2)
    # Request 2 prefills its first 5 tokens; the others prefill all of theirs.
    run.step([p if i != 2 else p[:5] for i, p in enumerate(prompts)])
    chunks = [[3], [4], prompts[2][5:], [5]]
    second = run.step(chunks)
    for i, (prompt, chunk, logits) in enumerate(zip(prompts, chunks, second)):
        full = prompt + chunk if i != 2 else prompt
        expected = hf_logits(path, full)[-len(chunk) :]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_inputs_embeds_equal_input_ids(make_checkpoint, paged_run):
    path = make_checkpoint()
    model = _load(path)
    prompts = _prompts(model.config.vocab_size)
    by_ids = paged_run(model, num_reqs=len(prompts), max_len=16).step(prompts)
    flat = torch.tensor([t for p in prompts for t in p])
    embeds = model.get_input_embeddings(flat)  # (num_tokens, hidden_size)
    run = paged_run(model, num_reqs=len(prompts), max_len=16)
    by_embeds = run.step(prompts, inputs_embeds=embeds)
    for a, b in zip(by_ids, by_embeds):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_forward_without_inputs_raises(make_checkpoint, paged_run):
    model = _load(make_checkpoint())
    run = paged_run(model, num_reqs=1, max_len=4)
    with pytest.raises(ValueError, match="needs input_ids or inputs_embeds"):
        model(None, torch.zeros(1, dtype=torch.int64), run.kv_caches, None)
