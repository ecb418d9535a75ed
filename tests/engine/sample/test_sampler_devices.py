"""The sampler creates every tensor it uses on the logits' device: run on `meta`, where a
host tensor mixed into the step fails as it would on a GPU."""

from __future__ import annotations

import torch
from kvferry.engine.sample import Sampler, SamplingMetadata
from kvferry.engine.sampling_params import SamplingParams

META = torch.device("meta")


def test_greedy_random_filters_penalties_logprobs_and_blocked_ids_stay_on_device() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, logprobs=3),
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.2, logprobs=0),
        SamplingParams(temperature=0.7, min_tokens=3),
    ]
    metadata = SamplingMetadata.build(
        params, output_token_ids=[[1, 2], [3], [4, 4, 5], []],
        prompt_token_ids=[[7, 8], [9], [1], [2]],
        stop_token_ids_to_block={3: [2]}, vocab_size=64, device=META)

    out = Sampler()(torch.empty(4, 64, device=META), metadata)

    assert out.sampled_token_ids.device == META and out.sampled_token_ids.shape == (4,)
    assert out.logprobs is not None and out.logprobs.logprobs.device == META


def test_grammar_bitmask_rows_are_applied_on_device() -> None:
    # The bitmask is filled on the host (pinned on a GPU machine) and copied once per step.
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=3)]
    bitmask = torch.zeros((1, 2), dtype=torch.int32)  # 64 tokens: two int32 words
    metadata = SamplingMetadata.build(
        params, output_token_ids=[[], []], prompt_token_ids=[[1], [2]],
        stop_token_ids_to_block={}, vocab_size=64, device=META,
        grammar_bitmask=([1], bitmask))

    assert metadata.grammar_rows is not None and metadata.grammar_rows.device == META
    assert metadata.grammar_bitmask is not None and metadata.grammar_bitmask.device == META
    out = Sampler()(torch.empty(2, 64, device=META), metadata)
    assert out.sampled_token_ids.device == META and out.sampled_token_ids.shape == (2,)
    # Every row under a grammar, in order: no row index tensor, one pass.
    every = SamplingMetadata.build(
        params, output_token_ids=[[], []], prompt_token_ids=[[1], [2]],
        stop_token_ids_to_block={}, vocab_size=64, device=META,
        grammar_bitmask=([0, 1], torch.zeros((2, 2), dtype=torch.int32)))
    assert every.grammar_rows is None and every.grammar_bitmask is not None
    assert Sampler()(torch.empty(2, 64, device=META), every).sampled_token_ids.device == META
