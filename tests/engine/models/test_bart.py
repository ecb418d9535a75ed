"""BART against HF transformers on the same random weights (float32, torch backend).

Requests with different encoder lengths run as one flat encoder batch; the decoder then
runs a prompt step and single-token steps through the paged cache, reading the cross
blocks `write_cross_kv` filled. HF runs each request alone with teacher forcing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvferry_testing.encdec_checkpoints import BART_BOS_ID, BART_EOS_ID, load_hf_encdec

from kvferry.engine.attention.torch_backend import TorchAttentionBackend
from kvferry.engine.models.bart import BartForConditionalGeneration
from kvferry.engine.models.encoder_decoder import EncoderBatch, EncoderDecoderModel
from kvferry.engine.models.loader import load_model

ATOL = 1e-4
NUM_DECODE_STEPS = 5

CASES = {
    "bart": {},
    # Scaled token embeddings, separate encoder/decoder tables and lm_head, tanh GELU, and
    # an encoder whose head count differs from the decoder's.
    "bart-scaled-untied": {
        "scale_embedding": True,
        "tie_word_embeddings": False,
        "activation_function": "gelu_new",
        "encoder_attention_heads": 2,
        "decoder_ffn_dim": 160,
    },
}


def _load(path: Path) -> BartForConditionalGeneration:
    return load_model(path, torch.float32, TorchAttentionBackend(), torch.device("cpu"))


def _encoder_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Three encoder inputs of different lengths (9, 15, 2), each <s> ... </s>."""
    gen = torch.Generator().manual_seed(seed)
    bodies = [torch.randint(4, vocab_size - 1, (n,), generator=gen).tolist() for n in (7, 13, 0)]
    return [[BART_BOS_ID, *body, BART_EOS_ID] for body in bodies]


def _encode(run, prompts: list[list[int]]) -> torch.Tensor:
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    return run.encode(input_ids=input_ids, positions=positions)


def _hf_run(hf, encoder_prompt: list[int], decoder_ids: list[int]):
    with torch.inference_mode():
        return hf(
            input_ids=torch.tensor([encoder_prompt]),
            decoder_input_ids=torch.tensor([decoder_ids]),
            output_hidden_states=True,
        )


@pytest.mark.parametrize("case", list(CASES))
def test_encode_prompt_and_decode_steps_match_hf(case, make_encdec_checkpoint, encdec_run):
    path = make_encdec_checkpoint("bart", **CASES[case])
    model = _load(path)
    hf = load_hf_encdec(path)
    prompts = _encoder_prompts(model.config.vocab_size)
    run = encdec_run(model, [len(p) for p in prompts], max_decoder_len=16)
    encoder_out = _encode(run, prompts)

    # Decoder prompts: the default [</s>, <s>], a longer one, the start token alone.
    decoder = [[BART_EOS_ID, BART_BOS_ID], [BART_EOS_ID, BART_BOS_ID, 17, 301, 5], [BART_EOS_ID]]
    logits = [[rows] for rows in run.step(decoder)]
    for _ in range(NUM_DECODE_STEPS):
        next_tokens = [[int(steps[-1][-1].argmax())] for steps in logits]
        for seq, token in zip(decoder, next_tokens):
            seq += token
        for steps, rows in zip(logits, run.step(next_tokens)):
            steps.append(rows)

    # Causal decoding: HF's logits over the whole sequence hold every step's rows.
    for prompt, out, seq, steps in zip(prompts, encoder_out.split([len(p) for p in prompts]),
                                       decoder, logits):
        ref = _hf_run(hf, prompt, seq)
        torch.testing.assert_close(out, ref.encoder_last_hidden_state[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.cat(steps), ref.logits[0], atol=ATOL, rtol=0)


def test_chunked_decoder_prompt_beside_decodes(make_encdec_checkpoint, encdec_run):
    """A decoder prompt split over two steps, sharing the second with another request's
    decode step, reads its own earlier chunk and the right cross blocks."""
    path = make_encdec_checkpoint("bart")
    model = _load(path)
    hf = load_hf_encdec(path)
    prompts = _encoder_prompts(model.config.vocab_size, seed=1)[:2]
    run = encdec_run(model, [len(p) for p in prompts], max_decoder_len=16)
    _encode(run, prompts)
    long_prompt = [BART_EOS_ID, BART_BOS_ID, 40, 41, 42, 43, 44, 45, 46]
    first = run.step([[BART_EOS_ID, BART_BOS_ID], long_prompt[:5]])
    decode_token = int(first[0][-1].argmax())
    second = run.step([[decode_token], long_prompt[5:]])
    ref0 = _hf_run(hf, prompts[0], [BART_EOS_ID, BART_BOS_ID, decode_token]).logits[0]
    ref1 = _hf_run(hf, prompts[1], long_prompt).logits[0]
    torch.testing.assert_close(torch.cat([first[0], second[0]]), ref0, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([first[1], second[1]]), ref1, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_cross_blocks_hold_hf_cross_attention_keys(case, make_encdec_checkpoint, encdec_run):
    path = make_encdec_checkpoint("bart", **CASES[case])
    model = _load(path)
    hf = load_hf_encdec(path)
    config = model.config
    prompts = _encoder_prompts(config.vocab_size, seed=2)
    run = encdec_run(model, [len(p) for p in prompts], max_decoder_len=4)
    _encode(run, prompts)
    heads = (config.num_heads, config.head_size)
    for r, prompt in enumerate(prompts):
        with torch.inference_mode():
            encoder_out = hf.model.encoder(input_ids=torch.tensor([prompt])).last_hidden_state[0]
            for i, layer in enumerate(hf.model.decoder.layers):
                keys, values = run.cross_kv(i, r)
                expected_k = layer.encoder_attn.k_proj(encoder_out).view(len(prompt), *heads)
                expected_v = layer.encoder_attn.v_proj(encoder_out).view(len(prompt), *heads)
                torch.testing.assert_close(keys, expected_k, atol=ATOL, rtol=0)
                torch.testing.assert_close(values, expected_v, atol=ATOL, rtol=0)


def test_inputs_embeds_equal_input_ids(make_encdec_checkpoint, encdec_run):
    """`get_input_embeddings` gives what the decoder reads (scaled, like HF's)."""
    path = make_encdec_checkpoint("bart", **CASES["bart-scaled-untied"])
    model = _load(path)
    prompts = _encoder_prompts(model.config.vocab_size)
    decoder = [[BART_EOS_ID, BART_BOS_ID], [BART_EOS_ID, BART_BOS_ID, 9], [BART_EOS_ID]]
    by_ids = encdec_run(model, [len(p) for p in prompts], max_decoder_len=8)
    _encode(by_ids, prompts)
    by_embeds = encdec_run(model, [len(p) for p in prompts], max_decoder_len=8)
    _encode(by_embeds, prompts)
    embeds = model.get_input_embeddings(torch.tensor([t for d in decoder for t in d]))
    for a, b in zip(by_ids.step(decoder), by_embeds.step(decoder, inputs_embeds=embeds)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_model_interface_and_input_errors(make_encdec_checkpoint, encdec_run):
    model = _load(make_encdec_checkpoint("bart"))
    assert isinstance(model, EncoderDecoderModel) and model.is_encoder_decoder
    run = encdec_run(model, [3], max_decoder_len=4)
    with pytest.raises(ValueError, match="needs input_ids and positions"):
        model.encode(EncoderBatch(metadata=None, input_features=torch.zeros(1, 1, 1)))
    with pytest.raises(ValueError, match="one slot per position"):
        model.write_cross_kv(torch.zeros(3, 64), run.kv_caches, torch.zeros(2, dtype=torch.int64))
    slots = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="got 1 KV cache views for a decoder of 2 layers"):
        model.write_cross_kv(torch.zeros(3, 64), run.kv_caches[:1], slots)
    metadata, positions = run.step_metadata([1])
    metadata.cross = None
    with pytest.raises(ValueError, match=r"needs the step's cross-attention metadata"):
        model(torch.tensor([BART_EOS_ID]), positions, run.kv_caches, metadata)

