"""The BART and Whisper test checkpoints: what both kvferry and transformers read from them,
that they come from the seed, and that HF's greedy `generate` on them is plain greedy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from kvferry_testing.encdec_checkpoints import (
    BART_BOS_ID,
    BART_EOS_ID,
    BART_PAD_ID,
    WHISPER_SPECIAL_TOKENS,
    load_hf_encdec,
    make_bart_checkpoint,
    make_whisper_checkpoint,
    whisper_decoder_prompt,
)
from safetensors.torch import load_file

from kvferry.engine.frontend.tokenizer import Tokenizer

TEXT = "Sola dirou kevi bami, nota."
NUM_NEW_TOKENS = 8


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("builder", [make_bart_checkpoint, make_whisper_checkpoint])
def test_built_from_the_seed(builder, tmp_path):
    first, again, other = (builder(tmp_path / name, seed) for name, seed in
                           (("a", 0), ("b", 0), ("c", 1)))
    a, b, c = _tensors(first), _tensors(again), _tensors(other)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not torch.equal(a["model.decoder.layers.0.fc1.weight"],
                           c["model.decoder.layers.0.fc1.weight"])
    assert (first / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_bart_tokenizer_and_ids(make_encdec_checkpoint):
    from transformers import AutoTokenizer

    path = make_encdec_checkpoint("bart")
    ours, hf = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(str(path))
    ids = ours.encode(TEXT)
    assert ids == hf(TEXT).input_ids
    assert ids[0] == BART_BOS_ID and ids[-1] == BART_EOS_ID and len(ids) > 4
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == TEXT
    assert (hf.bos_token_id, hf.pad_token_id, hf.eos_token_id) == (0, 1, 2)
    assert hf.mask_token_id == ours.vocab_size - 1 == 511
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == ours.vocab_size
    assert (config["decoder_start_token_id"], config["pad_token_id"]) == (BART_EOS_ID, BART_PAD_ID)
    # Nothing is forced on HF's generate (BART's default forces </s> at the last step).
    assert config.get("forced_eos_token_id") is None


def test_whisper_tokenizer_prompt_and_features(make_encdec_checkpoint):
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    path = make_encdec_checkpoint("whisper")
    ours, hf = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(str(path))
    assert ours.encode(TEXT) == hf(TEXT).input_ids
    specials = {t: ours.token_to_id(t) for t in WHISPER_SPECIAL_TOKENS}
    # The special tokens close the vocabulary, <|endoftext|> first, as in Whisper's.
    assert list(specials.values()) == list(range(512 - len(specials), 512))
    eot = specials["<|endoftext|>"]
    assert (ours.eos_token_id, hf.eos_token_id, hf.pad_token_id) == (eot, eot, eot)
    assert whisper_decoder_prompt(path) == [
        specials["<|startoftranscript|>"], specials["<|en|>"], specials["<|transcribe|>"],
        specials["<|notimestamps|>"],
    ]
    assert whisper_decoder_prompt(path, "fr", "translate")[1:3] == [
        specials["<|fr|>"], specials["<|translate|>"],
    ]
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["decoder_start_token_id"] == specials["<|startoftranscript|>"]
    assert generation["is_multilingual"] is True
    assert not {"suppress_tokens", "begin_suppress_tokens", "forced_decoder_ids"} & set(generation)
    # 2 s of 16 kHz audio, 160 samples a frame: 200 frames = 2 * max_source_positions.
    extractor = WhisperFeatureExtractor.from_pretrained(str(path))
    assert (extractor.n_samples, extractor.nb_max_frames) == (32000, 200)
    assert extractor.feature_size == 16
    features = extractor([np.zeros(5000, np.float32)], sampling_rate=16000, return_tensors="pt")
    assert tuple(features.input_features.shape) == (1, 16, 200)


def test_whisper_window_must_be_whole_seconds(tmp_path):
    with pytest.raises(ValueError, match="max_source_positions must be a multiple of 50, got 120"):
        make_whisper_checkpoint(tmp_path, max_source_positions=120)


def _teacher_forced_greedy(hf, encoder_input: dict, prompt: list[int]) -> list[int]:
    seq = list(prompt)
    for _ in range(NUM_NEW_TOKENS):
        with torch.inference_mode():
            logits = hf(**encoder_input, decoder_input_ids=torch.tensor([seq])).logits
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_hf_generate_is_plain_greedy_and_outputs_vary(make_encdec_checkpoint):
    """HF's `generate` with an explicit decoder prompt picks the argmax at every step (no
    token forced or suppressed), and the random weights give varied continuations."""
    bart = make_encdec_checkpoint("bart")
    hf = load_hf_encdec(bart)
    encoder_input = {"input_ids": torch.tensor([[BART_BOS_ID, 5, 80, 99, 100, 301, BART_EOS_ID]])}
    prompt = [BART_EOS_ID, BART_BOS_ID]
    with torch.inference_mode():
        out = hf.generate(**encoder_input, decoder_input_ids=torch.tensor([prompt]),
                          max_new_tokens=NUM_NEW_TOKENS, do_sample=False)
    greedy = _teacher_forced_greedy(hf, encoder_input, prompt)
    assert out[0].tolist() == prompt + greedy
    assert len(set(greedy)) >= 3

    whisper = make_encdec_checkpoint("whisper")
    hf = load_hf_encdec(whisper)
    noise = np.random.default_rng(0).standard_normal((1, 16, 200)).astype(np.float32)
    encoder_input = {"input_features": torch.from_numpy(noise)}
    prompt = whisper_decoder_prompt(whisper)
    with torch.inference_mode():
        out = hf.generate(**encoder_input, decoder_input_ids=torch.tensor([prompt]),
                          max_new_tokens=NUM_NEW_TOKENS, do_sample=False)
    greedy = _teacher_forced_greedy(hf, encoder_input, prompt)
    # Whisper's generate returns the new tokens only.
    assert out[0].tolist() == greedy
    assert len(set(greedy)) >= 3
