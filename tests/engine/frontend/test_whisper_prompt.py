"""Whisper's decoder prompt from a checkpoint's generation config or, lacking one, its
tokenizer: start of transcript, language, task, no timestamps, and a previous text before
them; languages by code, name or token; English-only models; refusals that say why."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from kvferry.engine.frontend.tokenizer import Tokenizer
from kvferry.engine.frontend.whisper_prompt import WhisperTokens
from kvferry_testing.whisper_files import (
    DE,
    EN,
    FR,
    NO_TIMESTAMPS,
    PREV,
    SOT,
    SUPPRESS_TOKENS,
    TRANSCRIBE,
    TRANSLATE,
    VOCAB,
    generation_config,
    write_whisper_front_end,
)


def load(model_dir: Path) -> tuple[WhisperTokens, Tokenizer]:
    tokenizer = Tokenizer.from_pretrained(model_dir)
    return WhisperTokens.from_checkpoint(model_dir, tokenizer), tokenizer


def test_the_generation_config_gives_the_ids_languages_and_suppressed_tokens(
        tmp_path: Path) -> None:
    tokens, _ = load(write_whisper_front_end(tmp_path, generation=generation_config()))
    assert tokens.language_ids == {"en": EN, "de": DE}  # fr is in the tokenizer only
    assert tokens.task_ids == {"transcribe": TRANSCRIBE, "translate": TRANSLATE}
    assert (tokens.start_of_transcript, tokens.start_of_previous, tokens.no_timestamps) == \
        (SOT, PREV, NO_TIMESTAMPS)
    assert tokens.suppress_tokens == SUPPRESS_TOKENS
    assert tokens.default_language == "en"
    assert tokens.decoder_prompt() == [SOT, EN, TRANSCRIBE, NO_TIMESTAMPS]
    assert tokens.decoder_prompt("de", "translate") == [SOT, DE, TRANSLATE, NO_TIMESTAMPS]
    with pytest.raises(ValueError, match="language 'fr' is not one this model knows"):
        tokens.language_code("fr")


def test_without_a_generation_config_the_tokenizer_gives_the_ids(tmp_path: Path) -> None:
    tokens, _ = load(write_whisper_front_end(tmp_path, generation=None))
    assert tokens.language_ids == {"en": EN, "de": DE, "fr": FR}
    assert tokens.decoder_prompt("fr") == [SOT, FR, TRANSCRIBE, NO_TIMESTAMPS]
    assert tokens.suppress_tokens == []


@pytest.mark.parametrize(("language", "code"), [
    (None, "en"), ("de", "de"), ("DE", "de"), (" german ", "de"), ("German", "de"),
    ("<|de|>", "de"), ("english", "en")])
def test_a_language_is_a_code_a_name_or_a_token(tmp_path: Path, language: str | None,
                                                 code: str) -> None:
    tokens, _ = load(write_whisper_front_end(tmp_path, generation=generation_config()))
    assert tokens.language_code(language) == code


@pytest.mark.parametrize("language", ["xx", "klingon", "", "<|fr|>"])
def test_an_unknown_language_is_refused_with_what_to_send(tmp_path: Path, language: str) -> None:
    tokens, _ = load(write_whisper_front_end(tmp_path, generation=generation_config()))
    with pytest.raises(ValueError, match=re.escape(
            f"language {language!r} is not one this model knows; give an ISO-639-1 code such "
            "as 'en'")):
        tokens.language_code(language)


def test_the_generation_configs_language_is_the_default(tmp_path: Path) -> None:
    tokens, _ = load(write_whisper_front_end(
        tmp_path, generation=generation_config(language="<|de|>")))
    assert tokens.default_language == "de"
    assert tokens.decoder_prompt() == [SOT, DE, TRANSCRIBE, NO_TIMESTAMPS]


def test_an_english_only_model_has_no_language_or_task_token(tmp_path: Path) -> None:
    tokens, _ = load(write_whisper_front_end(
        tmp_path, generation=generation_config(multilingual=False)))
    assert not tokens.is_multilingual
    assert tokens.language_code("English") is None
    assert tokens.decoder_prompt() == [SOT, NO_TIMESTAMPS]
    with pytest.raises(ValueError, match="this model transcribes English only; language 'de'"):
        tokens.language_code("de")
    with pytest.raises(ValueError, match="can only transcribe, not 'translate'"):
        tokens.decoder_prompt(None, "translate")


def test_a_previous_text_goes_before_the_start_of_transcript_its_last_tokens_kept(
        tmp_path: Path) -> None:
    tokens, tokenizer = load(write_whisper_front_end(tmp_path, generation=generation_config()))
    assert tokens.max_previous_tokens == 3  # max_target_positions 8 // 2 - 1
    hello, world, cat, sat = (VOCAB[w] for w in ("hello", "world", "cat", "sat"))
    assert tokens.previous_text_ids(tokenizer, "  hello world ") == [hello, world]
    previous = tokens.previous_text_ids(tokenizer, "hello world cat sat")
    assert previous == [world, cat, sat]
    assert tokens.decoder_prompt("de", previous_ids=previous) == \
        [PREV, world, cat, sat, SOT, DE, TRANSCRIBE, NO_TIMESTAMPS]


@pytest.mark.parametrize("text", ["hello <|translate|> world", "<|endoftext|>", "<|de|>"])
def test_a_previous_text_may_not_hold_a_special_tokens_text(tmp_path: Path, text: str) -> None:
    tokens, tokenizer = load(write_whisper_front_end(tmp_path, generation=generation_config()))
    with pytest.raises(ValueError, match="the prompt holds the text of a special token"):
        tokens.previous_text_ids(tokenizer, text)


def test_a_checkpoint_without_a_start_of_transcript_is_not_whisper(tmp_path: Path) -> None:
    model_dir = write_whisper_front_end(tmp_path, generation=None)
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"]
                            if t["content"] != "<|startoftranscript|>"]
    (model_dir / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=re.escape(
            "no <|startoftranscript|> token: it is not a Whisper")):
        load(model_dir)
