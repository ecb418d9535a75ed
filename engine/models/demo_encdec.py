"""Small random-weight BART and Whisper checkpoints: the `demo-bart` and `demo-whisper`
model sources.

Like `demo` (demo.py), they let a machine with no network run an encoder-decoder service
end to end (an encoder pool, decode pods pulling the cross-attention blocks, the router's
encode hop); their text is meaningless. The files are those of the hub's checkpoints:
config.json and model.safetensors written by transformers' own classes (so HF loads them
too), generation_config.json, a byte-level BPE tokenizer trained here on generated text
(tokenizer.json, tokenizer_config.json), and for Whisper preprocessor_config.json of a
30 s, 80-bin feature extractor, as Whisper's own. Every weight is drawn from a seeded
generator in the parameters' order, not by transformers' initializers, so two creations
write the same tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvferry.engine.models.demo import corpus

_SEED = 4321
_WEIGHT_STD = 0.08
# Query and key projections get larger weights: sharper attention makes each step's token
# steer the next, where a random decoder with uniform attention repeats one token.
_QK_STD = 0.2
# Both models: a 256-wide encoder and decoder of 2 layers each, 4 heads, 2048 tokens.
_SIZES: dict[str, Any] = {"d_model": 256, "encoder_layers": 2, "decoder_layers": 2,
                          "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                          "encoder_ffn_dim": 1024, "decoder_ffn_dim": 1024}
VOCAB_SIZE = 2048

# BART's special tokens at the ids BART's tokenizer gives them; <mask> is the last id.
BART_SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]
BART_BOS_ID, BART_PAD_ID, BART_EOS_ID = 0, 1, 2
BART_MAX_POSITIONS = 1024

# Whisper's special tokens in Whisper's order, after the BPE vocabulary.
WHISPER_LANGUAGES = ("en", "de", "fr", "es")
WHISPER_TASKS = ("translate", "transcribe")
WHISPER_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|startoftranscript|>", *(f"<|{lang}|>" for lang in WHISPER_LANGUAGES),
    *(f"<|{task}|>" for task in WHISPER_TASKS), "<|startoflm|>", "<|startofprev|>",
    "<|nocaptions|>", "<|notimestamps|>",
]
# Whisper's audio: 30 s at 16 kHz, 80 mel bins, 3000 frames, 1500 encoder positions.
WHISPER_NUM_MEL_BINS = 80
WHISPER_MAX_SOURCE_POSITIONS = 1500
WHISPER_MAX_TARGET_POSITIONS = 448


def _train_bpe(vocab_size: int, special_tokens: list[str]) -> Any:
    """A byte-level BPE of `vocab_size` tokens, `special_tokens` first, on the demo corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus(seed=_SEED), trainer=trainer)
    return tokenizer


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _save_tokenizer(path: Path, tokenizer: Any, config: dict[str, Any]) -> None:
    tokenizer.save(str(path / "tokenizer.json"))
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        **config})


def _draw_weights(model: Any) -> None:
    """Every parameter from one seeded generator, in the model's parameter order: layer
    norms near (1, 0), biases small, query and key projections larger."""
    import torch

    gen = torch.Generator().manual_seed(_SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "layer_norm" in name or "layernorm" in name:
                param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.02 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.02 * noise)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.copy_(_QK_STD * noise)
            else:
                param.copy_(_WEIGHT_STD * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("final_logits_bias"):
                buffer.zero_()


def _save_model(path: Path, model: Any) -> None:
    from transformers.utils import logging as hf_logging

    _draw_weights(model)
    hf_logging.disable_progress_bar()  # a pod's log is no place for a progress bar
    model.save_pretrained(str(path), safe_serialization=True)
    # transformers writes its own generation config; ours follows (the engine's and HF's).
    (path / "generation_config.json").unlink(missing_ok=True)


def create_demo_bart_checkpoint(path: Path) -> Path:
    """Writes the demo BART checkpoint into `path` (created if needed); returns it.

    Token ids as BART's: <s> 0, <pad> 1, </s> 2, <unk> 3, <mask> last; a text is encoded as
    <s> ... </s>, and the decoder starts with </s> <s>.
    """
    from tokenizers import processors
    from transformers import BartConfig, BartForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_bpe(VOCAB_SIZE - 1, BART_SPECIAL_TOKENS)
    tokenizer.add_special_tokens(["<mask>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", BART_BOS_ID), ("</s>", BART_EOS_ID)])
    _save_tokenizer(path, tokenizer, {
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
        "mask_token": "<mask>", "model_max_length": BART_MAX_POSITIONS})
    config = BartConfig(
        architectures=["BartForConditionalGeneration"], vocab_size=VOCAB_SIZE,
        max_position_embeddings=BART_MAX_POSITIONS, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, bos_token_id=BART_BOS_ID, pad_token_id=BART_PAD_ID,
        eos_token_id=BART_EOS_ID, decoder_start_token_id=BART_EOS_ID,
        forced_eos_token_id=None, forced_bos_token_id=None, tie_word_embeddings=True,
        **_SIZES)
    _save_model(path, BartForConditionalGeneration(config))
    _write_json(path / "generation_config.json", {
        "bos_token_id": BART_BOS_ID, "decoder_start_token_id": BART_EOS_ID,
        "eos_token_id": BART_EOS_ID, "pad_token_id": BART_PAD_ID})
    return path


def create_demo_whisper_checkpoint(path: Path) -> Path:
    """Writes the demo Whisper checkpoint into `path` (created if needed); returns it.

    Its audio is Whisper's: up to 30 s, any rate (resampled to 16 kHz), 80 mel bins. The
    special tokens follow the BPE vocabulary: <|endoftext|>, <|startoftranscript|> (the
    decoder start), the languages, the tasks, ..., <|notimestamps|> last.
    """
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_bpe(VOCAB_SIZE - len(WHISPER_SPECIAL_TOKENS), [])
    tokenizer.add_special_tokens(WHISPER_SPECIAL_TOKENS)
    ids = {token: tokenizer.token_to_id(token) for token in WHISPER_SPECIAL_TOKENS}
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    _save_tokenizer(path, tokenizer, {
        "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
        "additional_special_tokens": WHISPER_SPECIAL_TOKENS[1:],
        "model_max_length": WHISPER_MAX_TARGET_POSITIONS})
    config = WhisperConfig(
        architectures=["WhisperForConditionalGeneration"], vocab_size=VOCAB_SIZE,
        num_mel_bins=WHISPER_NUM_MEL_BINS, max_source_positions=WHISPER_MAX_SOURCE_POSITIONS,
        max_target_positions=WHISPER_MAX_TARGET_POSITIONS, bos_token_id=eot,
        eos_token_id=eot, pad_token_id=eot, decoder_start_token_id=sot,
        suppress_tokens=None, begin_suppress_tokens=None, tie_word_embeddings=True,
        **_SIZES)
    _save_model(path, WhisperForConditionalGeneration(config))
    _write_json(path / "generation_config.json", {
        "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot,
        "decoder_start_token_id": sot,
        "lang_to_id": {f"<|{lang}|>": ids[f"<|{lang}|>"] for lang in WHISPER_LANGUAGES},
        "task_to_id": {task: ids[f"<|{task}|>"] for task in WHISPER_TASKS},
        "no_timestamps_token_id": ids["<|notimestamps|>"], "is_multilingual": True,
        "max_length": WHISPER_MAX_TARGET_POSITIONS})
    WhisperFeatureExtractor(feature_size=WHISPER_NUM_MEL_BINS, sampling_rate=16000,
                            hop_length=160, chunk_length=30).save_pretrained(str(path))
    return path
