"""Prompts of encoder-decoder models (seed 004): which part goes to the encoder, which to
the decoder, and the decoder prompt a request gets when it names none.

Forms a request may take:
- A singleton prompt (text, `{"prompt": text}`, token ids, `{"prompt_token_ids": ids}`):
  the encoder's input; the decoder gets the model's default decoder prompt.
- `{"encoder_prompt": P, "decoder_prompt": Q}`: P is a singleton prompt for the encoder;
  Q (a singleton prompt, or None for the default) gets the decoder start token prepended
  unless it already begins with it.
- Audio encoders (Whisper): the encoder prompt is `{"multi_modal_data": {"audio":
  (samples, sample_rate)}}`; as a singleton prompt such a dict may also carry
  "prompt"/"prompt_token_ids", which are then the decoder prompt.

Default decoder prompts: BART-like models start with the decoder start token then BOS
(`[2, 0]` with BART's usual ids); Whisper with start of transcript, the language, the task
(transcribe) and no timestamps, read from its generation config (whisper_prompt.py). A
Whisper decoder prompt that begins with a previous text (<|startofprev|>) is kept whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from kvferry.engine.core.messages import EncoderInput
from kvferry.engine.frontend.whisper_prompt import WhisperTokens
from kvferry.engine.models.config import ModelArchConfig

if TYPE_CHECKING:
    from kvferry.engine.frontend.tokenizer import Tokenizer

ENCODER_PROMPT_KEYS = ("encoder_prompt", "decoder_prompt")
# The prompt keys a singleton prompt of a token encoder may carry.
_SINGLETON_KEYS = ("prompt", "prompt_token_ids")


def is_explicit_prompt(prompt: Any) -> bool:
    return isinstance(prompt, Mapping) and any(k in prompt for k in ENCODER_PROMPT_KEYS)


@dataclass
class EncoderDecoderPrompt:
    """A request's two prompts, tokenized (the encoder's may be audio features)."""

    encoder: EncoderInput
    decoder_text: str | None
    decoder_token_ids: list[int]


class EncoderDecoderPrompts:
    """Splits and tokenizes the prompts of one encoder-decoder model."""

    def __init__(self, model_dir: Path, tokenizer: Tokenizer) -> None:
        self.arch = ModelArchConfig.from_pretrained(model_dir)
        if not self.arch.is_encoder_decoder:
            raise ValueError(f"{model_dir} is not an encoder-decoder model")
        self.model_dir = Path(model_dir)
        self.tokenizer = tokenizer
        self.is_audio = self.arch.encoder_input == "audio"
        self._audio: Any = None  # the feature extractor, loaded with the first audio
        self.decoder_start_token_id = self._decoder_start_token_id()
        # Whisper's special tokens (start of transcript, languages, tasks, previous text).
        self.whisper = (WhisperTokens.from_checkpoint(model_dir, tokenizer) if self.is_audio
                        else None)

    # ------------------------------------------------------------------ defaults
    def _decoder_start_token_id(self) -> int:
        generation = self.arch.raw.get("generation_config", {})
        start = self.arch.decoder_start_token_id
        if start is None:
            start = generation.get("decoder_start_token_id")
        if start is None:
            raise ValueError(f"{self.model_dir}: the config names no decoder_start_token_id")
        return int(start)

    def default_decoder_prompt(self, language: str | None = None) -> list[int]:
        """The decoder prompt of a request that gives none (see the module docstring).

        Whisper: `language` is a code such as "en" (the generation config's default, else
        English, when None); ValueError for a language the model does not know."""
        start = self.decoder_start_token_id
        if self.whisper is None:
            bos = self.arch.bos_token_id
            return [start] if bos is None else [start, bos]
        return self.whisper.decoder_prompt(self.whisper.language_code(language))

    # ------------------------------------------------------------------ prompts
    def process(self, prompt: Any) -> EncoderDecoderPrompt:
        """The request's encoder input and decoder prompt; ValueError names what is wrong."""
        if is_explicit_prompt(prompt):
            unknown = set(prompt) - set(ENCODER_PROMPT_KEYS)
            if unknown:
                raise ValueError(f"an encoder/decoder prompt takes only encoder_prompt and "
                                 f"decoder_prompt; got {', '.join(sorted(map(str, unknown)))}")
            if prompt.get("encoder_prompt") is None:
                raise ValueError("encoder_prompt is missing: an encoder-decoder model needs an "
                                 "input for its encoder")
            encoder = self._encoder_input(prompt["encoder_prompt"])
            decoder = prompt.get("decoder_prompt")
            if decoder is None:
                return EncoderDecoderPrompt(encoder, None, self.default_decoder_prompt())
            text, ids = self._singleton(decoder, "decoder_prompt")
            return EncoderDecoderPrompt(encoder, text, self._with_start_token(ids))
        if isinstance(prompt, Mapping) and "multi_modal_data" in prompt:
            # One dict holding the audio and, optionally, the decoder prompt.
            encoder = self._encoder_input({"multi_modal_data": prompt["multi_modal_data"]})
            rest = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
            if not rest:
                return EncoderDecoderPrompt(encoder, None, self.default_decoder_prompt())
            text, ids = self._singleton(rest, "prompt")
            return EncoderDecoderPrompt(encoder, text, self._with_start_token(ids))
        return EncoderDecoderPrompt(self._encoder_input(prompt), None,
                                    self.default_decoder_prompt())

    def _with_start_token(self, ids: list[int]) -> list[int]:
        """A decoder prompt with the decoder start token first; Whisper's prompts that begin
        with a previous text (<|startofprev|> ... <|startoftranscript|> ...) are whole."""
        start = self.decoder_start_token_id
        previous = None if self.whisper is None else self.whisper.start_of_previous
        if ids and (ids[0] == start or (previous is not None and ids[0] == previous)):
            return ids
        return [start, *ids]

    def _encoder_input(self, prompt: Any) -> EncoderInput:
        if isinstance(prompt, Mapping) and "multi_modal_data" in prompt:
            if not self.is_audio:
                raise ValueError("this model's encoder reads text, not multi_modal_data")
            extra = set(prompt) - {"multi_modal_data"}
            if extra:
                raise ValueError("an audio encoder prompt takes only multi_modal_data; got "
                                 + ", ".join(sorted(map(str, extra))))
            return self.audio_input(_audio_of(prompt["multi_modal_data"]))
        if self.is_audio:
            raise ValueError("this model's encoder reads audio: give encoder_prompt as "
                             '{"multi_modal_data": {"audio": (samples, sample_rate)}}')
        text, ids = self._singleton(prompt, "encoder_prompt")
        if not ids:
            raise ValueError("the encoder prompt is empty: it must have at least one token")
        return EncoderInput(token_ids=ids, text=text)

    def audio_input(self, audio: tuple[np.ndarray, int]) -> EncoderInput:
        """Log-mel features of `(samples, sample_rate)` as the encoder's input."""
        samples, rate = audio
        features = self._feature_extractor().features(samples, rate)
        features = np.ascontiguousarray(features, dtype=np.float32)
        num_mel_bins, num_frames = features.shape
        return EncoderInput(features=features.tobytes(), num_mel_bins=num_mel_bins,
                            num_frames=num_frames)

    def _feature_extractor(self) -> Any:
        if self._audio is None:
            from kvferry.engine.frontend.audio import WhisperAudio

            self._audio = WhisperAudio(self.model_dir)
        return self._audio

    def _singleton(self, prompt: Any, where: str) -> tuple[str | None, list[int]]:
        """Text and token ids of a singleton prompt."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            extra = set(prompt) - set(_SINGLETON_KEYS)
            if extra:
                raise ValueError(f"{where} takes 'prompt' or 'prompt_token_ids'; got "
                                 + ", ".join(sorted(map(str, extra))))
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _ids(prompt["prompt_token_ids"], where)
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError(f"{where} needs 'prompt' (text) or 'prompt_token_ids' (ints)")
        if isinstance(prompt, (list, tuple)):
            return None, _ids(prompt, where)
        raise ValueError(f"{where} must be text, token ids or a dict, not "
                         f"{type(prompt).__name__}")


def _ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise ValueError(f"{where} token ids must be a list of integers")
    return list(value)


def _audio_of(data: Any) -> tuple[np.ndarray, int]:
    """The `(samples, sample_rate)` pair of a multi_modal_data dict, checked."""
    if not isinstance(data, Mapping) or set(data) != {"audio"}:
        raise ValueError('multi_modal_data must be {"audio": (samples, sample_rate)}')
    audio = data["audio"]
    if not isinstance(audio, (tuple, list)) or len(audio) != 2:
        raise ValueError("multi_modal_data audio must be a (samples, sample_rate) pair")
    samples, rate = audio
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
        raise ValueError(f"the audio's sample rate must be a positive integer, got {rate!r}")
    array = np.asarray(samples)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.number):
        raise ValueError("audio samples must be a 1-D array of numbers (mono)")
    if not np.isfinite(array).all():
        raise ValueError("audio samples must be finite")
    return array.astype(np.float32, copy=False), int(rate)
