"""Prompt logprobs (vLLM's `prompt_logprobs`) equal the log-softmax HF transformers computes
for each prompt token given the tokens before it, with chunked prefill, with a prompt whose
prefix is cached (such a request takes no cache hit), and beside requests that do not ask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvferry import LLM, SamplingParams

VOCAB_SIZE = 256
K = 3


def hf_prompt_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """(len(prompt) - 1, vocab) log-softmax of the logits predicting tokens 1..P-1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(dim=-1)


def check_against_hf(prompt_logprobs: list, prompt: list[int], expected: torch.Tensor) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry = prompt_logprobs[position]
        row = expected[position - 1]
        token = prompt[position]
        # The prompt's own token first, then the top K (a dict keeps the first of a repeat).
        assert next(iter(entry)) == token
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=2e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top_values, top_ids = row.topk(K)
        for j, (token_id, value) in enumerate(zip(top_ids.tolist(), top_values.tolist())):
            assert entry[token_id].logprob == pytest.approx(value, abs=2e-4)
            if token_id != token:
                assert entry[token_id].rank == j + 1


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("LlamaForCausalLM")


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_equal_hf(checkpoint, hf_model, chunk: int | None) -> None:
    kwargs = {"enable_chunked_prefill": True, "max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(model=str(checkpoint), device="cpu", max_model_len=256, block_size=8, **kwargs)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB_SIZE, size=n).tolist() for n in (1, 2, 9, 40, 77)]
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=K)
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    # Every other request asks for nothing: they share the steps with those that do.
    requests = [{"prompt_token_ids": p} for p in prompts for _ in range(2)]
    outputs = llm.generate(requests, [params, plain] * len(prompts), use_tqdm=False)
    model = hf_model(checkpoint)
    for index, prompt in enumerate(prompts):
        asked, other = outputs[2 * index], outputs[2 * index + 1]
        assert other.prompt_logprobs is None
        check_against_hf(asked.prompt_logprobs, prompt, hf_prompt_logprobs(model, prompt)
                         if len(prompt) > 1 else torch.empty(0, VOCAB_SIZE))
        # Asking for prompt logprobs changes nothing in the completion.
        assert asked.outputs[0].token_ids == other.outputs[0].token_ids


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(checkpoint, hf_model) -> None:
    llm = LLM(model=str(checkpoint), device="cpu", max_model_len=256, block_size=8,
              enable_prefix_caching=True)
    prompt = np.random.default_rng(1).integers(3, VOCAB_SIZE, size=50).tolist()
    first = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2),
                         use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(max_tokens=2, prompt_logprobs=K), use_tqdm=False)[0]
    assert first.prompt_logprobs is None
    assert again.num_cached_tokens == 0
    check_against_hf(again.prompt_logprobs, prompt, hf_prompt_logprobs(hf_model(checkpoint),
                                                                       prompt))


def test_prompt_logprobs_range_is_checked() -> None:
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\], got 21"):
        SamplingParams(prompt_logprobs=21)
