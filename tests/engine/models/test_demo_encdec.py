"""The `demo-bart` and `demo-whisper` model sources: byte-identical from any process, made
once in the cache, and the engine's greedy output on them equals HF transformers'."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.models.demo_encdec import (
    WHISPER_MAX_SOURCE_POSITIONS,
    create_demo_bart_checkpoint,
    create_demo_whisper_checkpoint,
)
from kvferry.engine.models.source import resolve_model_source

from kvferry import LLM, SamplingParams

MAX_TOKENS = 6
CREATORS = {"demo-bart": create_demo_bart_checkpoint,
            "demo-whisper": create_demo_whisper_checkpoint}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache the sources are made in (once per test module)."""
    return tmp_path_factory.mktemp("kvferry-cache")


@pytest.mark.parametrize("source", sorted(CREATORS))
def test_a_demo_source_is_made_once_and_byte_identical_from_another_process(
        source: str, cache: Path, tmp_path: Path) -> None:
    made = resolve_model_source(source, cache)
    assert made == cache / f"{source}-v1"
    stamp = (made / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_source(source, cache) == made  # found, not made again
    assert (made / "model.safetensors").stat().st_mtime_ns == stamp
    # A fresh interpreter catches anything seeded per process (hash seeds, Rust maps).
    code = (f"import sys; from pathlib import Path; from kvferry.engine.models.demo_encdec "
            f"import {CREATORS[source].__name__} as make; make(Path(sys.argv[1]))")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "again")], check=True)
    names = sorted(p.name for p in made.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "again").iterdir())
    for name in names:
        assert (made / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name
    arch = ModelArchConfig.from_pretrained(made)
    assert arch.is_encoder_decoder
    assert arch.encoder_input == ("audio" if source == "demo-whisper" else "tokens")


def test_demo_bart_generates_as_hf_does(cache: Path) -> None:
    from transformers import AutoTokenizer, BartForConditionalGeneration

    path = resolve_model_source("demo-bart", cache)
    llm = LLM(model=str(path), max_model_len=64, block_size=16, dtype="float32", device="cpu",
              seed=0)
    texts = ["Bako lime tura sen.", "Five hundred words of nothing much"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(texts, params, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = BartForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    for text, output in zip(texts, outputs):
        encoder_ids = tokenizer(text)["input_ids"]
        assert encoder_ids[0] == 0 and encoder_ids[-1] == 2  # <s> ... </s>, as BART's
        assert output.prompt_token_ids == [2, 0]  # </s> <s>: the decoder's default start
        ids = torch.tensor([[2, 0]])
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                logits = hf(input_ids=torch.tensor([encoder_ids]), decoder_input_ids=ids).logits
                ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert output.outputs[0].token_ids == ids[0, 2:].tolist()
    # A random model, but not a degenerate one: the two texts are not answered alike.
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids


def test_demo_whisper_transcribes_as_hf_does(cache: Path) -> None:
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    path = resolve_model_source("demo-whisper", cache)
    llm = LLM(model=str(path), max_model_len=64, block_size=16, dtype="float32", device="cpu",
              seed=0)
    rate = 16000
    t = np.arange(int(1.5 * rate)) / rate
    clip = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [output] = llm.generate([{"encoder_prompt": {"multi_modal_data": {"audio": (clip, rate)}},
                              "decoder_prompt": None}], params, use_tqdm=False)
    features = WhisperFeatureExtractor.from_pretrained(path)(
        clip, sampling_rate=rate, return_tensors="pt").input_features
    assert features.shape == (1, 80, 2 * WHISPER_MAX_SOURCE_POSITIONS)  # Whisper's 30 s window
    hf = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    prompt = output.prompt_token_ids
    assert len(prompt) == 4  # <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>
    ids = torch.tensor([prompt])
    with torch.no_grad():
        encoded = hf.model.encoder(features)
        for _ in range(MAX_TOKENS):
            logits = hf(encoder_outputs=encoded, decoder_input_ids=ids).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert output.outputs[0].token_ids == ids[0, len(prompt):].tolist()
