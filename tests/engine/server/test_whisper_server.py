"""A live `kvferry serve` of a small random Whisper checkpoint, through the official client:
every transcript (WAV at 16 kHz mono and 44.1 kHz stereo, FLAC; json, text and
verbose_json; a language; a previous text) equals the offline `LLM.generate` of the same
audio and decoder prompt, greedy, with the same token budget; every unusable upload is a
400 naming what is wrong (413 past the body limit), after which the server still
transcribes exactly; the text endpoints refuse the model; /metrics counts the encoder's
positions (once per distinct audio, with prefix caching) and frees the cross-attention
blocks when idle."""

from __future__ import annotations

import functools
import io
import wave
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile
from kvferry.engine.frontend.outputs import CompletionOutput
from kvferry_testing.encdec_checkpoints import make_whisper_checkpoint, whisper_decoder_prompt
from kvferry_testing.serve_helpers import ServerProcess
from openai.types.audio import TranscriptionVerbose

from kvferry import LLM, SamplingParams

URL = "/v1/audio/transcriptions"
# The checkpoint's decoder context (max_target_positions) and encoder positions; its chunk
# (the longest audio) is max_source_positions / 50 seconds.
MAX_MODEL_LEN = 64
ENCODER_POSITIONS = 100
CHUNK_SECONDS = 2
BLOCK_SIZE = 8
AUDIO_BODY_LIMIT = 400_000


@pytest.fixture(scope="module")
def whisper_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_whisper_checkpoint(tmp_path_factory.mktemp("whisper"), seed=5)


@pytest.fixture(scope="module")
def server(server_factory: Callable[..., ServerProcess], whisper_path: Path) -> Iterator[ServerProcess]:
    # Stopped with the module: servers of the whole session would not fit in memory.
    server = server_factory(whisper_path, "--served-model-name", "whisper",
                          "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
                          "--dtype", "float32", "--device", "cpu", "--enable-prefix-caching",
                          "--max-audio-body-bytes", str(AUDIO_BODY_LIMIT))
    yield server
    server.kill_group()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def offline(whisper_path: Path) -> LLM:
    return LLM(model=str(whisper_path), max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
               dtype="float32", device="cpu", num_gpu_blocks_override=200)


def tone(seed: int, seconds: float, rate: int) -> np.ndarray:
    """A tone of a seeded pitch with noise, float64 in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate)) / rate
    return 0.3 * np.sin(2 * np.pi * rng.uniform(100, 2000) * t) + 0.05 * rng.standard_normal(
        t.shape)


def pcm16(channels: list[np.ndarray]) -> np.ndarray:
    """(num_frames, num_channels) int16 samples."""
    return np.round(np.stack(channels, axis=1) * 32767).astype("<i2")


def wav_file(samples: np.ndarray, rate: int) -> bytes:
    """A 16-bit PCM WAV of (num_frames, num_channels) int16 samples, by the stdlib."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(samples.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return out.getvalue()


def mono_wav(seed: int, seconds: float, rate: int = 16000) -> tuple[bytes, np.ndarray]:
    """A mono WAV and its samples as float32 (what the file holds, read back)."""
    ints = pcm16([tone(seed, seconds, rate)])
    return wav_file(ints, rate), ints[:, 0].astype(np.float32) / 32768


def offline_transcript(offline: LLM, samples: np.ndarray, rate: int,
                       decoder_prompt: list[int]) -> CompletionOutput:
    """The offline API's greedy output for the audio, with the server's token budget: the
    decoder's context less its prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - len(decoder_prompt))
    (out,) = offline.generate(
        {"encoder_prompt": {"multi_modal_data": {"audio": (samples, rate)}},
         "decoder_prompt": decoder_prompt}, params, use_tqdm=False)
    assert out.prompt_token_ids == decoder_prompt
    completion = out.outputs[0]
    assert completion.token_ids  # a transcript to compare, not an empty one
    return completion


def verbose(client: openai.OpenAI, data: bytes, name: str = "a.wav",
            **fields: str) -> TranscriptionVerbose:
    return client.audio.transcriptions.create(model="whisper", file=(name, data),
                                              response_format="verbose_json", **fields)


@pytest.fixture(scope="module")
def reference(offline: LLM, whisper_path: Path) -> tuple[bytes, str]:
    """A short clip and the offline transcript the server must give for it."""
    data, samples = mono_wav(1, 0.5)
    expected = offline_transcript(offline, samples, 16000, whisper_decoder_prompt(whisper_path))
    return data, expected.text.strip()


def assert_transcribes(client: openai.OpenAI, reference: tuple[bytes, str]) -> None:
    data, text = reference
    out = client.audio.transcriptions.create(model="whisper", file=("ref.wav", data))
    assert out.text == text


def test_every_response_format_equals_the_offline_api(
        client: openai.OpenAI, offline: LLM, whisper_path: Path) -> None:
    data, samples = mono_wav(2, 1.2)
    expected = offline_transcript(offline, samples, 16000, whisper_decoder_prompt(whisper_path))
    text = expected.text.strip()
    as_json = client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                                 temperature=0)
    assert as_json.text == text
    assert as_json.usage is not None and as_json.usage.seconds == 1.2
    as_text = client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                                 response_format="text")
    assert as_text == text
    out = verbose(client, data)
    assert (out.text, out.language, out.duration) == (text, "english", 1.2)
    (segment,) = out.segments
    assert segment.tokens == expected.token_ids
    assert (segment.start, segment.end, segment.text, segment.temperature) == (0.0, 1.2, text,
                                                                               0.0)
    assert segment.avg_logprob < 0


def test_a_streamed_transcript_equals_the_offline_api(
        client: openai.OpenAI, offline: LLM, whisper_path: Path) -> None:
    data, samples = mono_wav(4, 1.5)
    expected = offline_transcript(offline, samples, 16000, whisper_decoder_prompt(whisper_path))
    events = list(client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                                     stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    (done,) = [e for e in events if e.type == "transcript.text.done"]
    assert events[-1] is done and len(deltas) > 1
    assert "".join(deltas) == done.text == expected.text.strip()
    assert done.usage is not None and done.usage.seconds == 1.5


def test_a_44_1_khz_stereo_wav_equals_the_offline_api_of_its_mixed_samples(
        client: openai.OpenAI, offline: LLM, whisper_path: Path) -> None:
    rate = 44100
    ints = pcm16([tone(3, 1.5, rate), tone(4, 1.5, rate)])
    left, right = (ints[:, i].astype(np.float32) / 32768 for i in (0, 1))
    # The channels averaged, at the file's own rate: the offline API resamples it.
    expected = offline_transcript(offline, (left + right) / 2, rate,
                                  whisper_decoder_prompt(whisper_path))
    out = verbose(client, wav_file(ints, rate))
    assert out.segments[0].tokens == expected.token_ids
    assert out.text == expected.text.strip()
    assert out.duration == 1.5


def test_a_flac_equals_the_offline_api(client: openai.OpenAI, offline: LLM,
                                       whisper_path: Path) -> None:
    buffer = io.BytesIO()
    soundfile.write(buffer, tone(5, 1.0, 22050), 22050, format="FLAC")
    data = buffer.getvalue()
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    expected = offline_transcript(offline, samples, rate, whisper_decoder_prompt(whisper_path))
    out = verbose(client, data, name="speech.flac")
    assert out.segments[0].tokens == expected.token_ids
    assert out.text == expected.text.strip()


def test_a_language_sets_the_decoder_prompts_language_token(
        client: openai.OpenAI, offline: LLM, whisper_path: Path) -> None:
    data, samples = mono_wav(6, 1.0)
    german = whisper_decoder_prompt(whisper_path, language="de")
    english = whisper_decoder_prompt(whisper_path, language="en")
    assert german != english
    expected_de = offline_transcript(offline, samples, 16000, german)
    expected_en = offline_transcript(offline, samples, 16000, english)
    assert expected_de.token_ids != expected_en.token_ids  # the prompt steers this model
    for language in ("de", "German", "<|de|>"):
        out = verbose(client, data, language=language)
        assert out.segments[0].tokens == expected_de.token_ids, language
        assert out.language == "german"
    assert verbose(client, data).segments[0].tokens == expected_en.token_ids


def test_a_prompt_goes_before_the_transcript_as_previous_text(
        client: openai.OpenAI, offline: LLM, whisper_path: Path) -> None:
    from transformers import AutoTokenizer

    data, samples = mono_wav(7, 1.0)
    hf = AutoTokenizer.from_pretrained(whisper_path)
    previous = "Kabo ditu zou lo"
    # <|startofprev|>, the text as Whisper encodes it (after a space), then the usual prompt.
    decoder_prompt = [hf.convert_tokens_to_ids("<|startofprev|>"),
                      *hf.encode(" " + previous, add_special_tokens=False),
                      *whisper_decoder_prompt(whisper_path)]
    expected = offline_transcript(offline, samples, 16000, decoder_prompt)
    plain = offline_transcript(offline, samples, 16000, whisper_decoder_prompt(whisper_path))
    assert expected.token_ids != plain.token_ids
    out = verbose(client, data, prompt=previous)
    assert out.segments[0].tokens == expected.token_ids
    assert out.text == expected.text.strip()


def damaged_wav() -> bytes:
    """A RIFF/WAVE header whose only chunk is data: no fmt chunk before it."""
    return b"RIFF" + (12).to_bytes(4, "little") + b"WAVE" + b"data" + (4).to_bytes(
        4, "little") + bytes(4)


@pytest.mark.parametrize(("data", "message"), [
    (b"", "the file is empty"),
    (b"\x00\x01 these bytes are not audio" * 8,
     "the file is not a WAV, FLAC or OGG file (its first bytes are none of theirs)"),
    (damaged_wav(), "the WAV file is damaged: its data chunk comes before its fmt chunk"),
    (b"fLaC" + bytes(100), "the FLAC file could not be decoded"),
    (wav_file(np.zeros((0, 1), "<i2"), 16000), "the file has no samples"),
    (mono_wav(8, CHUNK_SECONDS + 0.5)[0],
     (f"the audio lasts {CHUNK_SECONDS + 0.5:.2f} s, longer than the {CHUNK_SECONDS} s this "
      "model takes")),
])
def test_an_unusable_file_is_a_400_naming_file_and_the_server_goes_on(
        client: openai.OpenAI, reference: tuple[bytes, str], data: bytes,
        message: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.transcriptions.create(model="whisper", file=("a.wav", data))
    body = caught.value.body
    assert isinstance(body, dict)
    assert (body["type"], body["param"], body["code"]) == ("invalid_request_error", "file",
                                                          None)
    assert message in body["message"], body["message"]
    assert_transcribes(client, reference)


def test_audio_of_exactly_the_chunk_is_transcribed(client: openai.OpenAI, offline: LLM,
                                                   whisper_path: Path) -> None:
    data, samples = mono_wav(9, CHUNK_SECONDS)
    expected = offline_transcript(offline, samples, 16000, whisper_decoder_prompt(whisper_path))
    assert verbose(client, data).segments[0].tokens == expected.token_ids


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(("request_kwargs", "param", "message"), [
    ({"files": {"model": (None, "whisper")}}, "file", "file: Field required"),
    ({"files": {"file": ("a.wav", b"RIFF")}}, "model", "model: Field required"),
    ({"json": {"model": "whisper", "file": "UklGRg=="}}, None,
     ("/v1/audio/transcriptions takes a multipart/form-data body (the file and the fields "
      "as form parts), got content type 'application/json'")),
])
def test_a_form_without_a_field_or_a_json_body_is_a_400_and_the_server_goes_on(
        server: ServerProcess, client: openai.OpenAI, reference: tuple[bytes, str],
        request_kwargs: dict, param: str | None, message: str) -> None:
    error = error_of(httpx.post(f"{server.url}{URL}", timeout=60, **request_kwargs), 400)
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert message in error["message"], error["message"]
    assert_transcribes(client, reference)


def test_an_upload_over_the_audio_limit_is_a_413_and_the_server_goes_on(
        client: openai.OpenAI, reference: tuple[bytes, str]) -> None:
    data = wav_file(pcm16([tone(10, 2.0, 48000)] * 3), 48000)
    assert len(data) > AUDIO_BODY_LIMIT
    with pytest.raises(openai.APIStatusError) as caught:
        client.audio.transcriptions.create(model="whisper", file=("big.wav", data))
    assert caught.value.status_code == 413
    assert caught.value.body == {
        "message": f"the request body is larger than the limit of {AUDIO_BODY_LIMIT} bytes "
                   "(--max-audio-body-bytes)",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    assert_transcribes(client, reference)


def test_the_text_endpoints_refuse_a_model_that_reads_audio(
        client: openai.OpenAI, reference: tuple[bytes, str]) -> None:
    for create, kwargs, endpoint in [
        (client.completions.create, {"prompt": "hello"}, "/v1/completions"),
        (client.chat.completions.create, {"messages": [{"role": "user", "content": "hi"}]},
         "/v1/chat/completions"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            create(model="whisper", max_tokens=2, **kwargs)
        assert caught.value.body == {
            "message": f"this model's encoder reads audio: {endpoint} cannot serve it; send "
                       "the audio to /v1/audio/transcriptions",
            "type": "invalid_request_error", "param": "model", "code": None}
    assert_transcribes(client, reference)


def test_tokenize_gives_the_ids_of_a_prompts_text(server: ServerProcess,
                                                  whisper_path: Path) -> None:
    from transformers import AutoTokenizer

    text = "Kabo ditu zou"
    out = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=60).json()
    expected = AutoTokenizer.from_pretrained(whisper_path).encode(text,
                                                                  add_special_tokens=False)
    assert out["tokens"] == expected and out["count"] == len(expected)
    assert out["max_model_len"] == MAX_MODEL_LEN


def test_metrics_count_encoder_positions_once_per_distinct_audio(
        server: ServerProcess, client: openai.OpenAI) -> None:
    server.wait_metric("kvferry:cross_attention_blocks_in_use", 0)
    before = server.metric("kvferry:encoder_tokens_total")
    clips = [mono_wav(20 + i, 1.5)[0] for i in range(3)]
    # Each clip three times, three requests at a time: one encoder run per clip (a copy
    # waits for the run of its twin, or finds its cross blocks cached).
    calls = [functools.partial(client.audio.transcriptions.create, model="whisper",
                               file=("a.wav", clip)) for clip in clips for _ in range(3)]
    peak = server.peak_metric_while("kvferry:cross_attention_blocks_in_use", calls,
                                    concurrency=3)
    assert server.metric("kvferry:encoder_tokens_total") - before == ENCODER_POSITIONS * 3
    # A running request holds ceil(100 / 8) = 13 cross blocks.
    assert peak > 0 and peak % -(-ENCODER_POSITIONS // BLOCK_SIZE) == 0
    server.wait_metric("kvferry:cross_attention_blocks_in_use", 0)
    assert server.metric("kvferry:num_requests_waiting_for_encoder") == 0
    assert server.metric("vllm:num_requests_running") == 0
    # A refused upload runs nothing.
    with pytest.raises(openai.BadRequestError):
        client.audio.transcriptions.create(model="whisper", file=("a.wav", b"not audio"))
    assert server.metric("kvferry:encoder_tokens_total") - before == ENCODER_POSITIONS * 3


def test_the_server_logged_no_traceback(server: ServerProcess) -> None:
    assert "Traceback" not in server.log()
