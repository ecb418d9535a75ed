"""What /v1/audio/transcriptions does with a form before the engine sees it, on a Whisper
checkpoint's front-end files: every 400 names the field (file, language, prompt,
response_format, temperature) and says why; a good form becomes 16 kHz samples, the decoder
prompt and sampling params."""

from __future__ import annotations

import io
import json
import wave
import zlib

import numpy as np
import pytest
import soundfile
from kvferry.engine.frontend.outputs import CompletionOutput, Logprob
from kvferry.engine.frontend.tokenizer import Tokenizer
from kvferry.engine.server.errors import ApiError
from kvferry.engine.server.serving import ChoiceState
from kvferry.engine.server.transcriptions import (
    SUPPRESS_BIAS,
    Transcriber,
    TranscriptionForm,
    render,
    whisper_prompt,
)
from kvferry_testing.whisper_files import (
    DE,
    EN,
    NO_TIMESTAMPS,
    PREV,
    SOT,
    SUPPRESS_TOKENS,
    TRANSCRIBE,
    VOCAB,
    generation_config,
    write_whisper_front_end,
)

MAX_MODEL_LEN = 8


@pytest.fixture(scope="module")
def front_end(tmp_path_factory: pytest.TempPathFactory) -> tuple[Transcriber, Tokenizer]:
    model_dir = write_whisper_front_end(tmp_path_factory.mktemp("whisper"),
                                        generation=generation_config())
    tokenizer = Tokenizer.from_pretrained(model_dir)
    return Transcriber.load(str(model_dir), tokenizer), tokenizer


def wav(seconds: float, rate: int = 16000) -> bytes:
    t = np.arange(round(seconds * rate)) / rate
    ints = np.round(0.5 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(ints.tobytes())
    return out.getvalue()


def refusal(front_end: tuple[Transcriber, Tokenizer], data: bytes,
            **fields: object) -> ApiError:
    transcriber, tokenizer = front_end
    form = TranscriptionForm(model="whisper", **fields)  # type: ignore[arg-type]
    with pytest.raises(ApiError) as caught:
        transcriber.read_inputs(form, data, tokenizer, MAX_MODEL_LEN)
    assert caught.value.status == 400
    return caught.value


def test_a_good_form_becomes_samples_a_decoder_prompt_and_params(
        front_end: tuple[Transcriber, Tokenizer]) -> None:
    transcriber, tokenizer = front_end
    form = TranscriptionForm(model="whisper", language="German", temperature=0.5)
    inputs = transcriber.read_inputs(form, wav(2.0, rate=44100), tokenizer, MAX_MODEL_LEN)
    assert inputs.language == "de"
    assert inputs.sample_rate == 16000 and inputs.samples.shape == (32000,)
    assert inputs.duration_s == 2.0
    assert inputs.decoder_prompt == [SOT, DE, TRANSCRIBE, NO_TIMESTAMPS]
    params = inputs.params
    assert (params.temperature, params.max_tokens, params.logprobs) == (0.5, 4, None)
    assert params.logit_bias == dict.fromkeys(SUPPRESS_TOKENS, SUPPRESS_BIAS)
    assert whisper_prompt(inputs) == {
        "encoder_prompt": {"multi_modal_data": {"audio": (inputs.samples, 16000)}},
        "decoder_prompt": [SOT, DE, TRANSCRIBE, NO_TIMESTAMPS]}


def test_a_prompt_goes_before_the_transcript_and_verbose_json_asks_for_logprobs(
        front_end: tuple[Transcriber, Tokenizer]) -> None:
    transcriber, tokenizer = front_end
    form = TranscriptionForm(model="whisper", prompt="hello", response_format="verbose_json")
    inputs = transcriber.read_inputs(form, wav(0.5), tokenizer, 16)
    assert inputs.decoder_prompt == [PREV, VOCAB["hello"], SOT, EN, TRANSCRIBE, NO_TIMESTAMPS]
    assert (inputs.params.max_tokens, inputs.params.logprobs) == (10, 0)


@pytest.mark.parametrize(("data", "message"), [
    (b"", "the file is empty"),
    (b"PK\x03\x04 a zip file, not audio" * 4, "the file is not a WAV, FLAC or OGG file"),
    (wav(0.0), "the file has no samples"),
    (wav(30.5), "the audio lasts 30.50 s, longer than the 30 s this model takes"),
    (b"fLaC" + bytes(100), "the FLAC file could not be decoded"),
])
def test_a_file_that_is_not_usable_audio_is_a_400_naming_file(
        front_end: tuple[Transcriber, Tokenizer], data: bytes, message: str) -> None:
    error = refusal(front_end, data)
    assert error.param == "file"
    assert message in error.message


def test_a_long_flac_is_refused_from_its_header(front_end: tuple[Transcriber, Tokenizer]) -> None:
    out = io.BytesIO()
    soundfile.write(out, np.zeros(8000 * 31, np.float32), 8000, format="FLAC")
    error = refusal(front_end, out.getvalue())
    assert "the audio lasts 31.00 s" in error.message


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"response_format": "srt"}, "response_format",
     "response_format 'srt' is not supported; use json, text, verbose_json"),
    ({"response_format": "vtt"}, "response_format", "'vtt' is not supported"),
    ({"temperature": 1.5}, "temperature", "temperature must be in [0, 1], got 1.5"),
    ({"temperature": -0.1}, "temperature", "temperature must be in [0, 1], got -0.1"),
    ({"language": "xx"}, "language", "language 'xx' is not one this model knows"),
    ({"language": "fr"}, "language", "language 'fr' is not one this model knows"),
])
def test_a_bad_field_is_a_400_naming_it(front_end: tuple[Transcriber, Tokenizer],
                                        fields: dict[str, object], param: str,
                                        message: str) -> None:
    error = refusal(front_end, wav(0.5), **fields)
    assert error.param == param
    assert message in error.message
    # The cheap checks, which the route runs before it reads the file, refuse it too.
    form = TranscriptionForm(model="whisper", **fields)  # type: ignore[arg-type]
    with pytest.raises(ApiError) as caught:
        front_end[0].check_form(form)
    assert (caught.value.param, caught.value.message) == (param, error.message)


def test_a_prompt_holding_a_special_tokens_text_is_a_400_naming_prompt(
        front_end: tuple[Transcriber, Tokenizer]) -> None:
    error = refusal(front_end, wav(0.5), prompt="hello <|translate|>")
    assert error.param == "prompt"
    assert error.message == ("the prompt holds the text of a special token (such as "
                             "<|endoftext|> or <|en|>), which a prompt may not")


def test_a_prompt_that_leaves_no_room_for_a_transcript_is_refused(
        front_end: tuple[Transcriber, Tokenizer]) -> None:
    transcriber, tokenizer = front_end
    form = TranscriptionForm(model="whisper", prompt="hello world cat")
    with pytest.raises(ApiError) as caught:
        transcriber.read_inputs(form, wav(0.5), tokenizer, 7)
    assert caught.value.param == "prompt"
    assert caught.value.message == ("the prompt leaves no room for a transcript: the decoder "
                                    "prompt has 8 tokens, the model's context 7")


def transcript(*deltas: tuple[str, list[int], list[float]]) -> ChoiceState:
    """A choice as the engine's DELTA outputs build it: (text, token ids, their logprobs)."""
    choice = ChoiceState()
    for text, ids, logprobs in deltas:
        choice.add(CompletionOutput(
            index=0, text=text, token_ids=ids, cumulative_logprob=None,
            logprobs=[{t: Logprob(lp, 1)} for t, lp in zip(ids, logprobs)]))
    return choice


def test_the_transcript_is_rendered_in_each_response_format(
        front_end: tuple[Transcriber, Tokenizer]) -> None:
    transcriber, tokenizer = front_end
    form = TranscriptionForm(model="whisper", language="de", temperature=0.25,
                             response_format="verbose_json")
    inputs = transcriber.read_inputs(form, wav(1.2345), tokenizer, 16)
    hello, world = VOCAB["hello"], VOCAB["world"]
    choice = transcript((" hello", [hello], [-0.5]), (" world", [world], [-1.5]))
    usage = {"type": "duration", "seconds": 1.234}
    assert json.loads(render("json", inputs, choice).body) == {"text": "hello world",
                                                               "usage": usage}
    text = render("text", inputs, choice)
    assert (text.body, text.media_type) == (b"hello world", "text/plain")
    verbose = json.loads(render("verbose_json", inputs, choice).body)
    ratio = len(b"hello world") / len(zlib.compress(b"hello world"))
    assert verbose == {
        "task": "transcribe", "language": "german", "duration": 1.234, "text": "hello world",
        "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": 1.234, "text": "hello world",
                      "tokens": [hello, world], "temperature": 0.25, "avg_logprob": -1.0,
                      "compression_ratio": ratio}],
        "usage": usage}
