"""Whisper against HF transformers on the same random weights (float32, torch backend).

Three requests' log-mel features (from the checkpoint's own WhisperFeatureExtractor)
run as one flat encoder batch; the decoder then runs prompt steps and single-token steps
through the paged cache, reading the cross blocks `write_cross_kv` filled. HF runs each
request alone with teacher forcing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from kvferry_testing.encdec_checkpoints import (
    WHISPER_SAMPLING_RATE,
    load_hf_encdec,
    whisper_decoder_prompt,
)

from kvferry.engine.attention.torch_backend import TorchAttentionBackend
from kvferry.engine.models.encoder_decoder import EncoderBatch, EncoderDecoderModel
from kvferry.engine.models.loader import load_model
from kvferry.engine.models.whisper import WhisperForConditionalGeneration

ATOL = 1e-4
NUM_DECODE_STEPS = 5
# Seconds of audio per request: shorter than the window (padded), exact, longer (cut).
AUDIO_SECONDS = [0.7, 2.0, 2.6]

CASES = {
    "whisper": {},
    # Untied output projection, tanh GELU, an encoder shaped unlike the decoder.
    "whisper-untied": {
        "tie_word_embeddings": False,
        "activation_function": "gelu_pytorch_tanh",
        "encoder_attention_heads": 8,
        "encoder_ffn_dim": 80,
        "max_source_positions": 50,
    },
}


def _load(path: Path) -> WhisperForConditionalGeneration:
    return load_model(path, torch.float32, TorchAttentionBackend(), torch.device("cpu"))


def _features(path: Path, seed: int = 0) -> torch.Tensor:
    """(len(AUDIO_SECONDS), num_mel_bins, 2 * max_source_positions) log-mel features of
    noisy tones, from the checkpoint's feature extractor."""
    from transformers import WhisperFeatureExtractor

    rng = np.random.default_rng(seed)
    clips = []
    for i, seconds in enumerate(AUDIO_SECONDS):
        t = np.arange(int(seconds * WHISPER_SAMPLING_RATE)) / WHISPER_SAMPLING_RATE
        tone = np.sin(2 * np.pi * (220 + 150 * i) * t) + 0.3 * rng.standard_normal(t.size)
        clips.append(tone.astype(np.float32))
    extractor = WhisperFeatureExtractor.from_pretrained(str(path))
    out = extractor(clips, sampling_rate=WHISPER_SAMPLING_RATE, return_tensors="pt")
    return out.input_features


def _hf_run(hf, features: torch.Tensor, decoder_ids: list[int]):
    with torch.inference_mode():
        return hf(input_features=features[None], decoder_input_ids=torch.tensor([decoder_ids]))


@pytest.mark.parametrize("case", list(CASES))
def test_encode_prompt_and_decode_steps_match_hf(case, make_encdec_checkpoint, encdec_run):
    path = make_encdec_checkpoint("whisper", **CASES[case])
    model = _load(path)
    hf = load_hf_encdec(path)
    features = _features(path)
    num_positions = model.config.max_encoder_positions
    assert tuple(features.shape) == (3, model.config.num_mel_bins, 2 * num_positions)
    run = encdec_run(model, [num_positions] * 3, max_decoder_len=16)
    encoder_out = run.encode(input_features=features)

    # The usual prompt, another language and task, and the start token alone.
    decoder = [
        whisper_decoder_prompt(path),
        whisper_decoder_prompt(path, language="de", task="translate"),
        whisper_decoder_prompt(path)[:1],
    ]
    logits = [[rows] for rows in run.step(decoder)]
    for _ in range(NUM_DECODE_STEPS):
        next_tokens = [[int(steps[-1][-1].argmax())] for steps in logits]
        for seq, token in zip(decoder, next_tokens):
            seq += token
        for steps, rows in zip(logits, run.step(next_tokens)):
            steps.append(rows)

    # Causal decoding: HF's logits over the whole sequence hold every step's rows.
    for r, (seq, steps) in enumerate(zip(decoder, logits)):
        ref = _hf_run(hf, features[r], seq)
        expected_out = ref.encoder_last_hidden_state[0]
        torch.testing.assert_close(
            encoder_out[r * num_positions : (r + 1) * num_positions], expected_out,
            atol=ATOL, rtol=0,
        )
        torch.testing.assert_close(torch.cat(steps), ref.logits[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_cross_blocks_hold_hf_cross_attention_keys(case, make_encdec_checkpoint, encdec_run):
    path = make_encdec_checkpoint("whisper", **CASES[case])
    model = _load(path)
    hf = load_hf_encdec(path)
    config = model.config
    features = _features(path, seed=1)
    num_positions = config.max_encoder_positions
    run = encdec_run(model, [num_positions] * 3, max_decoder_len=4)
    run.encode(input_features=features)
    heads = (num_positions, config.num_heads, config.head_size)
    with torch.inference_mode():
        encoder_out = hf.model.encoder(input_features=features).last_hidden_state
    for r in range(len(AUDIO_SECONDS)):
        for i, layer in enumerate(hf.model.decoder.layers):
            keys, values = run.cross_kv(i, r)
            with torch.inference_mode():
                # Whisper's key projections have no bias.
                expected_k = layer.encoder_attn.k_proj(encoder_out[r]).view(heads)
                expected_v = layer.encoder_attn.v_proj(encoder_out[r]).view(heads)
            torch.testing.assert_close(keys, expected_k, atol=ATOL, rtol=0)
            torch.testing.assert_close(values, expected_v, atol=ATOL, rtol=0)


def test_key_bias_blocks_are_zero(make_encdec_checkpoint):
    model = _load(make_encdec_checkpoint("whisper"))
    hidden = model.config.hidden_size
    for layer in model.model.decoder.layers:
        assert torch.count_nonzero(layer.self_attn.qkv_proj.bias[hidden : 2 * hidden]) == 0
        assert torch.count_nonzero(layer.encoder_attn.kv_proj.bias[:hidden]) == 0
        # The query and value biases around them were loaded.
        assert torch.count_nonzero(layer.self_attn.qkv_proj.bias[:hidden]) == hidden
        assert torch.count_nonzero(layer.encoder_attn.kv_proj.bias[hidden:]) == hidden


def test_model_interface_and_input_errors(make_encdec_checkpoint, encdec_run):
    path = make_encdec_checkpoint("whisper")
    model = _load(path)
    assert isinstance(model, EncoderDecoderModel) and model.is_encoder_decoder
    run = encdec_run(model, [100, 100], max_decoder_len=4)
    metadata = run.encoder_metadata()
    with pytest.raises(ValueError, match="needs input_features"):
        model.encode(EncoderBatch(metadata=metadata, input_ids=torch.zeros(200, dtype=torch.int64)))
    with pytest.raises(ValueError) as err:
        model.encode(EncoderBatch(metadata=metadata, input_features=torch.zeros(2, 16, 199)))
    assert str(err.value) == (
        "Whisper input_features must be (num_reqs, num_mel_bins, frames) = (2, 16, 200), "
        "got (2, 16, 199)"
    )
    short = encdec_run(model, [100, 99], max_decoder_len=4).encoder_metadata()
    with pytest.raises(ValueError, match="must hold 100 positions per request"):
        model.encode(EncoderBatch(metadata=short, input_features=torch.zeros(2, 16, 200)))



def test_a_missing_bias_other_than_the_key_one_is_an_error(make_encdec_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(make_encdec_checkpoint("whisper"), tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.decoder.layers.1.encoder_attn.v_proj.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        _load(tmp_path)
    assert str(err.value) == (
        f"checkpoint {tmp_path} is missing 1 tensors the model needs: "
        "model.decoder.layers.1.encoder_attn.v_proj.bias"
    )
