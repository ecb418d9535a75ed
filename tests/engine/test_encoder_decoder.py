"""Encoder-decoder models through the whole engine: greedy output equals HF transformers
token for token (BART and Whisper on random float32 weights), with different encoder
lengths in one batch, chunked decoder prompts, cross blocks taken from the prefix cache,
forced preemption, and both attention backends (Triton under its interpreter on CPU).
Every block is back in the pool afterwards.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from kvferry_testing.encdec_checkpoints import (
    make_bart_checkpoint,
    make_whisper_checkpoint,
    whisper_decoder_prompt,
)

from kvferry import LLM, SamplingParams

BART_VOCAB = 512
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def bart_path(tmp_path_factory) -> Path:
    return make_bart_checkpoint(tmp_path_factory.mktemp("bart"), seed=3)


@pytest.fixture(scope="module")
def whisper_path(tmp_path_factory) -> Path:
    return make_whisper_checkpoint(tmp_path_factory.mktemp("whisper"), seed=5)


@pytest.fixture(scope="module")
def hf_bart(bart_path):
    from transformers import BartForConditionalGeneration

    return BartForConditionalGeneration.from_pretrained(bart_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_whisper(whisper_path):
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(
        whisper_path, dtype=torch.float32).eval()


def _plain_greedy(model, max_tokens: int):
    """The model's generation config with every constraint off: greedy, EOS disabled."""
    config = copy.deepcopy(model.generation_config)
    for name in ("forced_bos_token_id", "forced_eos_token_id", "suppress_tokens",
                 "begin_suppress_tokens", "forced_decoder_ids"):
        setattr(config, name, None)
    config.no_repeat_ngram_size = 0
    config.num_beams = 1
    config.do_sample = False
    config.min_length = 0
    config.eos_token_id = []
    config.max_new_tokens = max_tokens
    config.max_length = None
    return config


def hf_bart_greedy(model, encoder_ids: list[int], decoder_ids: list[int],
                   max_tokens: int = MAX_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([encoder_ids]),
                             decoder_input_ids=torch.tensor([decoder_ids]),
                             generation_config=_plain_greedy(model, max_tokens))
    return out[0, len(decoder_ids):].tolist()


def hf_whisper_greedy(model, features: np.ndarray, decoder_ids: list[int],
                      max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy decoding with HF's forward and its own KV cache (Whisper's `generate` adds
    language detection and timestamp logic of its own; this is the plain model)."""
    ids = torch.tensor([decoder_ids])
    with torch.no_grad():
        encoder_out = model.model.encoder(torch.from_numpy(features)[None])
        past = None
        generated: list[int] = []
        step_ids = ids
        for _ in range(max_tokens):
            out = model(encoder_outputs=encoder_out, decoder_input_ids=step_ids,
                        past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            generated.append(token)
            step_ids = torch.tensor([[token]])
    return generated


def _bart_llm(path: Path, **overrides) -> LLM:
    kwargs = dict(max_model_len=128, block_size=8, num_gpu_blocks_override=400, seed=0,
                  dtype="float32", device="cpu")
    kwargs.update(overrides)
    return LLM(model=str(path), **kwargs)


def _assert_all_blocks_free(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    manager = core.kv_cache_manager
    assert manager.num_free_blocks == manager.block_pool.num_blocks - 1
    assert not manager.req_to_cross_blocks and not manager.req_to_blocks


def _bart_requests(seed: int, num: int, decoder_len: tuple[int, int] = (0, 6)):
    """(encoder ids, decoder prompt or None) pairs of varied lengths."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(num):
        encoder = [0] + rng.integers(4, BART_VOCAB, size=int(rng.integers(1, 60))).tolist() + [2]
        n = int(rng.integers(*decoder_len))
        decoder = None if i % 3 == 0 else [2, 0] + rng.integers(4, BART_VOCAB, size=n).tolist()
        requests.append((encoder, decoder))
    return requests


def _bart_prompts(requests):
    return [{"encoder_prompt": {"prompt_token_ids": enc},
             "decoder_prompt": None if dec is None else {"prompt_token_ids": dec}}
            for enc, dec in requests]


def _check_bart(llm: LLM, hf_bart, requests, max_tokens: int = MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(_bart_prompts(requests), params, use_tqdm=False)
    for (enc, dec), output in zip(requests, outputs):
        decoder = dec if dec is not None else [2, 0]
        assert output.prompt_token_ids == decoder
        assert output.encoder_prompt_token_ids == enc
        assert output.outputs[0].token_ids == hf_bart_greedy(hf_bart, enc, decoder, max_tokens)
    _assert_all_blocks_free(llm)
    return outputs


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bart_batch_of_different_encoder_lengths_equals_hf(bart_path, hf_bart, backend) -> None:
    llm = _bart_llm(bart_path, attention_backend=backend)
    assert llm.llm_engine.engine_core.runner.attn_backend.name == backend
    outputs = _check_bart(llm, hf_bart, _bart_requests(1, 10 if backend == "torch" else 6))
    assert len({len(o.encoder_prompt_token_ids) for o in outputs}) > 3


def test_bart_chunked_decoder_prompts_and_preemption_equal_hf(bart_path, hf_bart) -> None:
    # A budget of 12 tokens chunks the long decoder prompts; 40 blocks of 8 for 8 requests
    # of up to 8 cross and 8 self blocks each force preemption.
    llm = _bart_llm(bart_path, max_num_batched_tokens=12, num_gpu_blocks_override=40,
                    max_num_encoder_tokens=64)
    requests = _bart_requests(2, 8, decoder_len=(20, 45))
    _check_bart(llm, hf_bart, requests, max_tokens=12)
    stats = llm.llm_engine.stats
    assert stats.scheduler.num_preemptions > 0
    longest = max(len(dec or ()) for _, dec in requests)
    assert longest > 12  # some decoder prompt ran in several chunks


def test_bart_cross_blocks_from_the_prefix_cache_skip_the_encoder(bart_path, hf_bart) -> None:
    llm = _bart_llm(bart_path)
    rng = np.random.default_rng(9)
    encoder = [0] + rng.integers(4, BART_VOCAB, size=37).tolist() + [2]
    llm.encode([{"prompt_token_ids": encoder}])
    stats = llm.llm_engine.stats
    ran = stats.encoder_tokens_total
    assert ran == len(encoder)
    # Four requests with the same encoder input and different decoder prompts: none runs
    # the encoder again, and all read the same cross blocks.
    requests = [(encoder, [2, 0] + rng.integers(4, BART_VOCAB, size=k).tolist())
                for k in (0, 3, 9, 17)]
    _check_bart(llm, hf_bart, requests)
    assert stats.encoder_tokens_total == ran
    # A plain text prompt of the same model goes to the encoder with the default decoder
    # prompt [decoder_start, bos].
    out = llm.generate("hello there", SamplingParams(max_tokens=3, temperature=0),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == [2, 0] and out.encoder_prompt == "hello there"
    assert out.encoder_prompt_token_ids == llm.get_tokenizer().encode("hello there")


def test_bart_prompt_forms_and_refusals(bart_path) -> None:
    llm = _bart_llm(bart_path)
    params = SamplingParams(max_tokens=2, temperature=0)
    explicit = llm.generate({"encoder_prompt": "the rain", "decoder_prompt": [0, 51, 178]},
                            params, use_tqdm=False)[0]
    assert explicit.prompt_token_ids == [2, 0, 51, 178]  # the decoder start is prepended
    kept = llm.generate({"encoder_prompt": [0, 171, 5, 2], "decoder_prompt": [2, 0, 51]},
                        params, use_tqdm=False)[0]
    assert kept.prompt_token_ids == [2, 0, 51] and kept.encoder_prompt_token_ids == [0, 171, 5, 2]
    for bad, message in [
        ({"decoder_prompt": [2, 0]}, "encoder_prompt is missing"),
        ({"encoder_prompt": []}, "encoder prompt is empty"),
        ({"encoder_prompt": [0, BART_VOCAB + 5]}, "outside the vocabulary"),
        ({"encoder_prompt": list(range(4, 200))}, "encoder's maximum"),
        ({"encoder_prompt": "x", "extra": 1}, "takes only encoder_prompt"),
        ({"encoder_prompt": {"multi_modal_data": {"audio": ([0.0], 16000)}}}, "reads text"),
        ({"prompt_embeds": torch.zeros(2, 64)}, "takes no prompt embeddings"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate(bad, params, use_tqdm=False)
    _assert_all_blocks_free(llm)


def test_bart_text_prompt_is_bounded_by_the_encoder_not_the_decoder(bart_path, hf_bart) -> None:
    # The decoder's context is 16 tokens; the encoder takes 128 positions, and a text
    # prompt is the encoder's input.
    llm = _bart_llm(bart_path, max_model_len=16)
    text = " ".join(["Kabo ditu zou lo ga"] * 8)
    ids = llm.get_tokenizer().encode(text)
    assert 16 < len(ids) <= 128
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate(text, params, use_tqdm=False)[0]
    assert out.encoder_prompt_token_ids == ids and out.prompt_token_ids == [2, 0]
    assert out.outputs[0].token_ids == hf_bart_greedy(hf_bart, ids, [2, 0], 4)
    with pytest.raises(ValueError, match="more than the encoder's maximum of 128$"):
        llm.generate("Kabo ditu " * 400, params, use_tqdm=False)
    _assert_all_blocks_free(llm)


def _audio(seed: int, seconds: float, rate: int = 16000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 2000) * t)
    return (tone + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_whisper_transcribes_audio_as_hf_does(whisper_path, hf_whisper, backend) -> None:
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(whisper_path)
    llm = LLM(model=str(whisper_path), max_model_len=64, block_size=8, seed=0,
              dtype="float32", device="cpu", attention_backend=backend,
              num_gpu_blocks_override=200 if backend == "torch" else 60,
              max_num_batched_tokens=16)
    prompt = whisper_decoder_prompt(whisper_path)
    clips = [_audio(i, seconds) for i, seconds in enumerate([0.4, 1.7, 2.0, 1.0])]
    clips.append(clips[1])  # the same audio twice shares its cross blocks
    requests = [{"encoder_prompt": {"multi_modal_data": {"audio": (clip, 16000)}},
                 "decoder_prompt": None} for clip in clips]
    # A prompt given at another rate is resampled first.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(requests, params, use_tqdm=False)
    for clip, output in zip(clips, outputs):
        assert output.prompt_token_ids == prompt
        features = extractor(clip, sampling_rate=16000, return_tensors="np").input_features[0]
        assert output.outputs[0].token_ids == hf_whisper_greedy(hf_whisper, features, prompt)
    assert outputs[-1].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    stats = llm.llm_engine.stats
    positions = llm.llm_engine.engine_core.arch.max_encoder_positions
    assert stats.encoder_tokens_total == positions * (len(clips) - 1)
    _assert_all_blocks_free(llm)


def test_whisper_preemption_reruns_no_encoder_and_equals_hf(whisper_path, hf_whisper) -> None:
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(whisper_path)
    # 100 encoder positions = 13 cross blocks of 8 per request; 4 requests growing to 36
    # tokens in a pool of 60 blocks: somebody is preempted.
    llm = LLM(model=str(whisper_path), max_model_len=64, block_size=8, seed=0,
              dtype="float32", device="cpu", num_gpu_blocks_override=60)
    prompt = whisper_decoder_prompt(whisper_path)
    clips = [_audio(10 + i, 1.5) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(
        [{"multi_modal_data": {"audio": (clip, 16000)}} for clip in clips], params,
        use_tqdm=False)
    stats = llm.llm_engine.stats
    assert stats.scheduler.num_preemptions > 0
    for clip, output in zip(clips, outputs):
        features = extractor(clip, sampling_rate=16000, return_tensors="np").input_features[0]
        assert output.outputs[0].token_ids == hf_whisper_greedy(hf_whisper, features, prompt,
                                                                32)
    _assert_all_blocks_free(llm)


def test_whisper_prompt_forms(whisper_path) -> None:
    llm = LLM(model=str(whisper_path), max_model_len=64, block_size=8, seed=0,
              dtype="float32", device="cpu", num_gpu_blocks_override=100)
    params = SamplingParams(max_tokens=2, temperature=0)
    clip = _audio(3, 1.0)
    # The audio at 8 kHz is resampled; a decoder prompt in the same dict is the decoder's.
    half_rate = clip[::2].copy()
    prompt = whisper_decoder_prompt(whisper_path, language="de")
    out = llm.generate({"multi_modal_data": {"audio": (half_rate, 8000)},
                        "prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt and out.encoder_prompt is None
    for bad, message in [
        ("plain text", "reads audio"),
        ({"multi_modal_data": {"audio": (np.zeros((2, 10)), 16000)}}, "1-D"),
        ({"multi_modal_data": {"audio": (clip, 0)}}, "sample rate"),
        ({"multi_modal_data": {"video": clip}}, "multi_modal_data must be"),
        ({"multi_modal_data": {"audio": (np.array([np.nan]), 16000)}}, "finite"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate(bad, params, use_tqdm=False)
    _assert_all_blocks_free(llm)
