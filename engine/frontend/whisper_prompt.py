"""Whisper's decoder prompt: the special tokens that say what to do with the audio.

A multilingual checkpoint reads

    [<|startofprev|> previous text] <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>

and an English-only one (`whisper-*.en`) has neither the language nor the task token:
`<|startoftranscript|> <|notimestamps|>`. The previous text (OpenAI's `prompt`) is optional
context the model continues from. Token ids come from the checkpoint's generation config
(`lang_to_id`, `task_to_id`, `decoder_start_token_id`, ...) where it has them, else from the
tokenizer by their text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvferry.engine.frontend.tokenizer import Tokenizer

TRANSCRIBE = "transcribe"
TRANSLATE = "translate"
# The language of a request that names none, when the generation config names none either.
DEFAULT_LANGUAGE = "en"
# Whisper's decoder context when config.json does not say (max_target_positions).
DEFAULT_MAX_TARGET_POSITIONS = 448


def whisper_languages() -> dict[str, str]:
    """ISO-639-1 code -> English name ("en" -> "english") of every language Whisper knows."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return dict(LANGUAGES)


def _language_aliases() -> dict[str, str]:
    """Lower-case names and alternative names -> code ("english" -> "en", "castilian" -> "es")."""
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    return dict(TO_LANGUAGE_CODE)


def _strip_token(text: str) -> str:
    """ "<|en|>" -> "en"; other text unchanged."""
    if text.startswith("<|") and text.endswith("|>"):
        return text[2:-2]
    return text


@dataclass(frozen=True)
class WhisperTokens:
    """The special token ids of one Whisper checkpoint and the prompts they make."""

    start_of_transcript: int
    # <|startofprev|>, which begins a previous text; None: the model takes none.
    start_of_previous: int | None
    # <|notimestamps|>; None: the prompt goes without it.
    no_timestamps: int | None
    # Language code ("en") -> the id of its token ("<|en|>"); empty for English-only models.
    language_ids: dict[str, int]
    # "transcribe" / "translate" -> the id of its token; empty for English-only models.
    task_ids: dict[str, int]
    # The language of a request that names none; None for English-only models.
    default_language: str | None
    # Ids Whisper never emits (the generation config's suppress_tokens).
    suppress_tokens: list[int]
    # The most tokens of previous text a prompt keeps (its last ones): as openai-whisper,
    # half the decoder's context less one, so the transcript keeps the other half.
    max_previous_tokens: int

    @property
    def is_multilingual(self) -> bool:
        return bool(self.language_ids)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, tokenizer: Tokenizer) -> WhisperTokens:
        """Reads `config.json` and `generation_config.json` of `model_dir` (either may be
        missing); ValueError when a token the prompt needs is nowhere to be found."""
        model_dir = Path(model_dir)
        config = _read_optional_json(model_dir / "config.json")
        generation = _read_optional_json(model_dir / "generation_config.json")
        return cls.from_configs(config, generation, tokenizer)

    @classmethod
    def from_configs(cls, config: Mapping[str, Any], generation: Mapping[str, Any],
                     tokenizer: Tokenizer) -> WhisperTokens:
        def token_id(key: str, text: str) -> int | None:
            value = generation.get(key, config.get(key))
            return int(value) if value is not None else tokenizer.token_to_id(text)

        start = token_id("decoder_start_token_id", "<|startoftranscript|>")
        if start is None:
            raise ValueError("the checkpoint names no decoder_start_token_id and its tokenizer "
                             "has no <|startoftranscript|> token: it is not a Whisper model")
        languages, tasks = _language_ids(generation, tokenizer), _task_ids(generation, tokenizer)
        if generation.get("is_multilingual") is False:
            languages, tasks = {}, {}
        if languages and TRANSCRIBE not in tasks:
            raise ValueError("the checkpoint is multilingual but has no <|transcribe|> token")
        max_positions = int(config.get("max_target_positions", DEFAULT_MAX_TARGET_POSITIONS))
        tokens = cls(
            start_of_transcript=start,
            start_of_previous=token_id("prev_sot_token_id", "<|startofprev|>"),
            no_timestamps=token_id("no_timestamps_token_id", "<|notimestamps|>"),
            language_ids=languages,
            task_ids=tasks,
            default_language=None,
            suppress_tokens=[int(t) for t in generation.get("suppress_tokens")
                             or config.get("suppress_tokens") or ()],
            max_previous_tokens=max(max_positions // 2 - 1, 0),
        )
        if not languages:
            return tokens
        named = generation.get("language")
        default = tokens.language_code(named) if named else None
        if default is None and DEFAULT_LANGUAGE in languages:
            default = DEFAULT_LANGUAGE
        return replace(tokens, default_language=default)

    def language_code(self, language: str | None) -> str | None:
        """The code of `language` (a code such as "en", a name such as "English", or a token
        such as "<|en|>"), or the default when it is None; None for an English-only model.
        ValueError names a language this model does not know."""
        if not self.is_multilingual:
            if language is not None and _normalize(language) != "en":
                raise ValueError(f"this model transcribes English only; language "
                                 f"{language!r} is not possible")
            return None
        if language is None:
            if self.default_language is None:
                raise ValueError("this model needs a language: give an ISO-639-1 code such as "
                                 "'en', 'de' or 'fr'")
            return self.default_language
        code = _normalize(language)
        if code not in self.language_ids:
            raise ValueError(f"language {language!r} is not one this model knows; give an "
                             "ISO-639-1 code such as 'en', 'de' or 'fr'")
        return code

    def decoder_prompt(self, language: str | None = None, task: str = TRANSCRIBE,
                       previous_ids: list[int] | None = None) -> list[int]:
        """The ids a transcript starts from: [previous text], start of transcript, language
        and task (multilingual models), no timestamps. `language` is a code from
        `language_code`; ValueError for a task the model has no token for."""
        prompt: list[int] = []
        if previous_ids:
            if self.start_of_previous is None:
                raise ValueError("this model takes no previous text (it has no <|startofprev|> "
                                 "token)")
            prompt += [self.start_of_previous, *previous_ids]
        prompt.append(self.start_of_transcript)
        if self.is_multilingual:
            code = self.language_code(language)
            assert code is not None
            if task not in self.task_ids:
                raise ValueError(f"this model has no {task!r} task; it knows "
                                 f"{', '.join(sorted(self.task_ids))}")
            prompt += [self.language_ids[code], self.task_ids[task]]
        elif task != TRANSCRIBE:
            raise ValueError(f"this English-only model can only {TRANSCRIBE}, not {task!r}")
        if self.no_timestamps is not None:
            prompt.append(self.no_timestamps)
        return prompt

    def previous_text_ids(self, tokenizer: Tokenizer, text: str) -> list[int]:
        """The ids of a previous text, as Whisper encodes it (a space, then the text without
        its surrounding spaces), its last `max_previous_tokens` kept. ValueError when the
        text holds a special token's text, such as "<|translate|>", which would steer the
        model. A long text takes a while: call it off the event loop."""
        ids = tokenizer.encode_in_thread(" " + text.strip(), add_special_tokens=False)
        if tokenizer.decode(ids, skip_special_tokens=True) != \
                tokenizer.decode(ids, skip_special_tokens=False):
            raise ValueError("the prompt holds the text of a special token (such as "
                             "<|endoftext|> or <|en|>), which a prompt may not")
        if self.max_previous_tokens == 0:
            return []
        return ids[-self.max_previous_tokens:]


def _normalize(language: str) -> str:
    """A language as the user wrote it -> its code, when it names one (else lower-cased)."""
    text = _strip_token(language.strip()).lower()
    return _language_aliases().get(text, text)


def _language_ids(generation: Mapping[str, Any], tokenizer: Tokenizer) -> dict[str, int]:
    table = generation.get("lang_to_id")
    if isinstance(table, Mapping) and table:
        return {_strip_token(str(token)): int(i) for token, i in table.items()}
    found = {code: tokenizer.token_to_id(f"<|{code}|>") for code in whisper_languages()}
    return {code: i for code, i in found.items() if i is not None}


def _task_ids(generation: Mapping[str, Any], tokenizer: Tokenizer) -> dict[str, int]:
    table = generation.get("task_to_id")
    if isinstance(table, Mapping) and table:
        return {str(task): int(i) for task, i in table.items()}
    found = {task: tokenizer.token_to_id(f"<|{task}|>") for task in (TRANSCRIBE, TRANSLATE)}
    return {task: i for task, i in found.items() if i is not None}


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} could not be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data
