"""The files of a Whisper checkpoint that its audio front end reads, without weights:
`preprocessor_config.json` (WhisperFeatureExtractor's), a word-level `tokenizer.json` holding
Whisper's special tokens, `generation_config.json` and a `config.json` with the decoder's
context. `write_whisper_front_end(dir)` writes them; the token ids below are theirs.
"""

from __future__ import annotations

import json
from pathlib import Path

# Plain words, then Whisper's special tokens, in the order (not at the ids) of the real
# vocabulary. Each word is one token; a text's ids are its words' ids.
WORDS = ("<unk>", "hello", "world", "the", "cat", "sat")
SPECIALS = ("<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|fr|>",
            "<|translate|>", "<|transcribe|>", "<|startoftlm|>", "<|startofprev|>",
            "<|nospeech|>", "<|notimestamps|>")
VOCAB = {token: i for i, token in enumerate(WORDS + SPECIALS)}
EOS, SOT, EN, DE, FR = (VOCAB[t] for t in ("<|endoftext|>", "<|startoftranscript|>", "<|en|>",
                                           "<|de|>", "<|fr|>"))
TRANSLATE, TRANSCRIBE, PREV, NO_TIMESTAMPS = (VOCAB[t] for t in (
    "<|translate|>", "<|transcribe|>", "<|startofprev|>", "<|notimestamps|>"))
# What the generation config says Whisper never emits (here: two plain words).
SUPPRESS_TOKENS = [VOCAB["the"], VOCAB["sat"]]
# The decoder's context (config.json's max_target_positions): a previous text keeps its
# last MAX_TARGET_POSITIONS // 2 - 1 = 3 tokens.
MAX_TARGET_POSITIONS = 8


def generation_config(*, multilingual: bool = True, language: str | None = None) -> dict:
    """As transformers writes a Whisper checkpoint's, for the languages en and de only (the
    tokenizer has fr too: the config decides)."""
    config: dict = {
        "decoder_start_token_id": SOT, "eos_token_id": EOS, "no_timestamps_token_id":
        NO_TIMESTAMPS, "prev_sot_token_id": PREV, "suppress_tokens": SUPPRESS_TOKENS,
        "is_multilingual": multilingual,
    }
    if multilingual:
        config["lang_to_id"] = {"<|en|>": EN, "<|de|>": DE}
        config["task_to_id"] = {"translate": TRANSLATE, "transcribe": TRANSCRIBE}
    if language is not None:
        config["language"] = language
    return config


def write_whisper_front_end(model_dir: Path, *, generation: dict | None = None,
                            feature_size: int = 80, chunk_length: int = 30) -> Path:
    """Writes the front end's files into `model_dir`; `generation=None` writes no
    generation config (token ids then come from the tokenizer)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import WhisperFeatureExtractor

    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({w: VOCAB[w] for w in WORDS}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    assert all(tokenizer.token_to_id(t) == VOCAB[t] for t in SPECIALS)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    WhisperFeatureExtractor(feature_size=feature_size, chunk_length=chunk_length
                            ).save_pretrained(str(model_dir))
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["WhisperForConditionalGeneration"],
        "max_target_positions": MAX_TARGET_POSITIONS, "decoder_start_token_id": SOT}))
    if generation is not None:
        (model_dir / "generation_config.json").write_text(json.dumps(generation))
    return model_dir
