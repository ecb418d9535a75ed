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
