"""Encoder-decoder models on a GPU: BART and Whisper in float32 with both attention
backends equal HF transformers on the CPU token for token (greedy, random weights).

These run where CUDA is (`pytest -m gpu`, scripts/device_check.sh) and skip elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvferry_testing.encdec_checkpoints import (
    make_bart_checkpoint,
    make_whisper_checkpoint,
    whisper_decoder_prompt,
)

from kvferry import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)"),
]

MAX_TOKENS = 8


def _greedy(model, **inputs) -> list[int]:
    """HF's plain greedy continuation (its forward, one token at a time), on the CPU."""
    ids = inputs.pop("decoder_input_ids")
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(**inputs, decoder_input_ids=ids).logits[0, -1]
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, -MAX_TOKENS:].tolist()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bart_on_cuda_equals_hf(tmp_path, backend) -> None:
    from transformers import BartForConditionalGeneration

    path = make_bart_checkpoint(tmp_path / "bart", seed=3)
    hf = BartForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    encoders = [[0, *rng.integers(4, 512, size=n).tolist(), 2] for n in (5, 40, 17, 90)]
    llm = LLM(model=str(path), device="cuda", dtype="float32", attention_backend=backend,
              max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": e} for e in encoders], params, use_tqdm=False)
    for encoder, output in zip(encoders, outputs):
        expected = _greedy(hf, input_ids=torch.tensor([encoder]),
                           decoder_input_ids=torch.tensor([[2, 0]]))
        assert output.outputs[0].token_ids == expected


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_whisper_on_cuda_equals_hf(tmp_path, backend) -> None:
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    path = make_whisper_checkpoint(tmp_path / "whisper", seed=5)
    hf = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    extractor = WhisperFeatureExtractor.from_pretrained(path)
    rng = np.random.default_rng(2)
    clips = [(0.3 * rng.standard_normal(int(16000 * s))).astype(np.float32)
             for s in (0.5, 1.2, 2.0)]
    llm = LLM(model=str(path), device="cuda", dtype="float32", attention_backend=backend,
              max_model_len=64, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"multi_modal_data": {"audio": (c, 16000)}} for c in clips],
                           params, use_tqdm=False)
    prompt = whisper_decoder_prompt(path)
    for clip, output in zip(clips, outputs):
        features = extractor(clip, sampling_rate=16000, return_tensors="pt").input_features
        expected = _greedy(hf, input_features=features,
                           decoder_input_ids=torch.tensor([prompt]))
        assert output.outputs[0].token_ids == expected
