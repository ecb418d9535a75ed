"""Audio files decoded to mono samples (WAV here, FLAC and OGG through libsndfile), refused with
a message that says why, resampled without aliasing, and turned into the same log-mel
features as transformers' WhisperFeatureExtractor."""

from __future__ import annotations

import io
import json
import struct
import wave
from pathlib import Path

import numpy as np
import pytest
import soundfile
from kvferry.engine.frontend.audio import WhisperAudio, decode_audio, resample
from transformers import WhisperFeatureExtractor


def tone(freq: float, rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(round(rate * seconds)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def pcm16(samples: np.ndarray) -> np.ndarray:
    """(frames,) or (frames, channels) floats -> int16 PCM."""
    return np.round(samples * 32767).astype("<i2")


def stdlib_wav(frames: np.ndarray, rate: int) -> bytes:
    """A 16-bit PCM WAV written by the standard library's `wave`."""
    channels = 1 if frames.ndim == 1 else frames.shape[1]
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames.tobytes())
    return out.getvalue()


def soundfile_bytes(frames: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, frames, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def riff(*chunks: tuple[bytes, bytes]) -> bytes:
    """A RIFF/WAVE file of the given (id, body) chunks, each padded to an even size."""
    body = b"WAVE"
    for chunk_id, data in chunks:
        body += chunk_id + struct.pack("<I", len(data)) + data + b"\0" * (len(data) & 1)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def fmt_chunk(channels: int = 1, rate: int = 16000, bits: int = 16, tag: int = 1) -> bytes:
    align = channels * bits // 8
    return struct.pack("<HHIIHH", tag, channels, rate, rate * align, align, bits)


# ---------------------------------------------------------------- WAV


@pytest.mark.parametrize("rate", [8000, 16000, 44100])
def test_16_bit_pcm_wav_decodes_to_its_exact_samples_and_rate(rate: int) -> None:
    ints = pcm16(tone(440, rate, 0.25))
    samples, got_rate = decode_audio(stdlib_wav(ints, rate))
    assert got_rate == rate
    assert samples.dtype == np.float32 and samples.shape == ints.shape
    np.testing.assert_array_equal(samples, ints.astype(np.float32) / 32768)


def test_stereo_is_mixed_down_to_the_mean_of_its_channels() -> None:
    left, right = tone(440, 16000, 0.1), tone(1000, 16000, 0.1, amplitude=0.25)
    ints = pcm16(np.stack([left, right], axis=1))
    samples, _ = decode_audio(stdlib_wav(ints, 16000))
    expected = (ints[:, 0].astype(np.float32) / 32768 + ints[:, 1].astype(np.float32) / 32768) / 2
    np.testing.assert_allclose(samples, expected, atol=1e-7)


@pytest.mark.parametrize(("fmt", "subtype", "tolerance"), [
    ("WAV", "PCM_U8", 1 / 128),
    ("WAV", "PCM_24", 1 / 2 ** 23),
    ("WAV", "PCM_32", 1 / 2 ** 31),
    ("WAV", "FLOAT", 0.0),
    ("WAV", "DOUBLE", 0.0),
    ("WAVEX", "PCM_16", 1 / 2 ** 15),  # the extensible header: the format in a GUID
    ("WAV", "ULAW", 0.02),  # not read here: handed to libsndfile
    ("FLAC", "PCM_16", 1 / 2 ** 15),
])
def test_other_encodings_decode_to_the_written_samples(fmt: str, subtype: str,
                                                       tolerance: float) -> None:
    stereo = np.stack([tone(300, 22050, 0.2), tone(300, 22050, 0.2, amplitude=-0.25)], axis=1)
    samples, rate = decode_audio(soundfile_bytes(stereo, 22050, fmt, subtype))
    assert rate == 22050
    assert samples.shape == (stereo.shape[0],)
    np.testing.assert_allclose(samples, stereo.mean(axis=1), atol=tolerance + 1e-7)


def test_24_bit_pcm_keeps_the_sign_of_negative_samples() -> None:
    values = np.array([-(2 ** 23), -1, 0, 1, 2 ** 23 - 1])
    data = b"".join(int(v).to_bytes(3, "little", signed=True) for v in values)
    samples, _ = decode_audio(riff((b"fmt ", fmt_chunk(bits=24)), (b"data", data)))
    np.testing.assert_array_equal(samples, values.astype(np.float32) / 2 ** 23)


def test_ogg_vorbis_decodes_to_its_length_rate_and_tone() -> None:
    samples, rate = decode_audio(soundfile_bytes(tone(1000, 16000, 1.0), 16000, "OGG"))
    assert rate == 16000
    assert samples.shape == (16000,)
    spectrum = np.abs(np.fft.rfft(samples))
    assert np.argmax(spectrum) == 1000  # 1 Hz per bin over one second


def test_chunks_before_the_data_are_skipped_and_a_short_data_chunk_is_cut_to_the_file() -> None:
    ints = pcm16(tone(440, 16000, 0.01))
    data = ints.tobytes()
    list_chunk = (b"LIST", b"INFOISFT\x05\x00\x00\x00test\x00")  # odd size: a pad byte follows
    whole = riff((b"fmt ", fmt_chunk()), list_chunk, (b"data", data))
    samples, _ = decode_audio(whole)
    np.testing.assert_array_equal(samples, ints.astype(np.float32) / 32768)
    # A recorder that never wrote the sizes back: the data runs to the end of the file.
    header = whole[:-len(data)]
    unfinished = header[:-4] + struct.pack("<I", 0xFFFFFFFF) + data[:101]
    samples, _ = decode_audio(unfinished)
    np.testing.assert_array_equal(samples, ints[:50].astype(np.float32) / 32768)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(("data", "message"), [
    (b"", "the file is empty"),
    (b"\x00\x01garbage that is not audio" * 10, "not a WAV, FLAC or OGG file"),
    (b"ID3\x04\x00" + bytes(100), "not a WAV, FLAC or OGG file"),
    (riff((b"fmt ", fmt_chunk()), (b"data", b"")), "the file has no samples"),
    (riff((b"fmt ", fmt_chunk()), (b"data", b"\x01")), "the file has no samples"),
    (riff((b"data", b"\0\0"), (b"fmt ", fmt_chunk())), "data chunk comes before its fmt chunk"),
    (riff((b"fmt ", fmt_chunk())), "it has no data chunk"),
    (riff((b"fmt ", b"\x01\x00")), "its fmt chunk is too short"),
    (riff((b"fmt ", fmt_chunk(channels=0)), (b"data", b"\0\0")), "says 0 channels"),
    (riff((b"fmt ", fmt_chunk(rate=500)), (b"data", b"\0\0")), "sample rate of 500 Hz"),
    (riff((b"fmt ", fmt_chunk(bits=32, tag=3)), (b"data", struct.pack("<f", np.nan))),
     "not finite"),
    (b"fLaC" + bytes(60), "the FLAC file could not be decoded"),
    (b"OggS" + bytes(60), "the OGG file could not be decoded"),
])
def test_a_file_that_cannot_be_used_is_refused_saying_why(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_audio(data)


def test_a_truncated_flac_is_refused() -> None:
    data = soundfile_bytes(tone(440, 16000, 0.5), 16000, "FLAC")
    with pytest.raises(ValueError, match="the FLAC file could not be decoded"):
        decode_audio(data[:40])


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_a_file_longer_than_the_limit_is_refused_with_both_lengths(fmt: str) -> None:
    data = soundfile_bytes(tone(440, 8000, 3.5), 8000, fmt, "PCM_16")
    with pytest.raises(ValueError, match=r"the audio lasts 3\.50 s, longer than the 3 s"):
        decode_audio(data, max_seconds=3)
    samples, _ = decode_audio(data, max_seconds=3.5)
    assert samples.shape == (28000,)


# ---------------------------------------------------------------- resampling


def dominant_frequency(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum) * rate / len(samples))


@pytest.mark.parametrize(("rate", "freq"), [(44100, 1000.0), (8000, 440.0), (48000, 3000.0),
                                            (22051, 1000.0)])
def test_resampling_keeps_a_tones_frequency_and_the_duration(rate: int, freq: float) -> None:
    out = resample(tone(freq, rate, 2.0), rate, 16000)
    assert out.dtype == np.float32
    assert abs(len(out) - 32000) <= 1
    assert dominant_frequency(out, 16000) == pytest.approx(freq, abs=1.0)
    # The tone keeps its level away from the edges.
    middle = out[4000:-4000]
    assert np.sqrt(np.mean(middle ** 2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.01)


def test_resampling_filters_out_what_is_above_the_new_nyquist_rate() -> None:
    # 10 kHz cannot be represented at 16 kHz: it must vanish, not fold back to 6 kHz.
    out = resample(tone(10000, 48000, 1.0), 48000, 16000)
    assert np.sqrt(np.mean(out[1000:-1000] ** 2)) < 1e-3


# ---------------------------------------------------------------- Whisper's features


def write_preprocessor(model_dir: Path, **overrides: object) -> Path:
    """A checkpoint's preprocessor_config.json, as WhisperFeatureExtractor saves it."""
    model_dir.mkdir(parents=True, exist_ok=True)
    WhisperFeatureExtractor(**overrides).save_pretrained(str(model_dir))
    return model_dir


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_preprocessor(tmp_path_factory.mktemp("whisper"))


def reference_features(model_dir: Path, samples_16k: np.ndarray) -> np.ndarray:
    extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))
    out = extractor(samples_16k, sampling_rate=16000, return_tensors="np")
    return out["input_features"][0]


def test_features_of_16_khz_audio_equal_the_feature_extractors(whisper_dir: Path) -> None:
    audio = WhisperAudio(whisper_dir)
    assert (audio.sampling_rate, audio.max_seconds, audio.num_mel_bins, audio.num_frames) == \
        (16000, 30.0, 80, 3000)
    samples = np.random.default_rng(0).uniform(-0.5, 0.5, 16000 * 3).astype(np.float32)
    features = audio.features(samples, 16000)
    assert features.shape == (80, 3000) and features.dtype == np.float32
    np.testing.assert_array_equal(features, reference_features(whisper_dir, samples))


def test_features_of_44_1_khz_audio_are_those_of_its_16_khz_resampling(whisper_dir: Path) -> None:
    samples = tone(700, 44100, 2.0)
    features = WhisperAudio(whisper_dir).features(samples, 44100)
    np.testing.assert_array_equal(features, reference_features(whisper_dir,
                                                               resample(samples, 44100, 16000)))


def test_a_128_bin_extractor_is_read_from_its_config(tmp_path: Path) -> None:
    # large-v3 computes 128 mel bins.
    audio = WhisperAudio(write_preprocessor(tmp_path, feature_size=128))
    assert audio.features(tone(440, 16000, 1.0), 16000).shape == (128, 3000)


def test_exactly_the_chunk_is_taken_and_longer_audio_is_refused(whisper_dir: Path) -> None:
    audio = WhisperAudio(whisper_dir)
    assert audio.features(tone(440, 44100, 30.0), 44100).shape == (80, 3000)
    with pytest.raises(ValueError, match=r"the audio lasts 30\.50 s, longer than the 30 s"):
        audio.features(tone(440, 16000, 30.5), 16000)


@pytest.mark.parametrize(("samples", "rate", "message"), [
    (np.zeros(0, np.float32), 16000, "the audio has no samples"),
    (np.zeros((2, 100), np.float32), 16000, r"one channel \(a 1-D array\), got shape \(2, 100\)"),
    (np.array(["a"]), 16000, "must be numbers"),
    (np.array([0.0, np.inf], np.float32), 16000, "not finite"),
    (np.zeros(100, np.float32), 16000.0, "the sample rate must be an integer"),
    (np.zeros(100, np.float32), 100, "sample rate of 100 Hz"),
])
def test_samples_that_are_not_usable_audio_are_refused(whisper_dir: Path, samples: np.ndarray,
                                                       rate: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WhisperAudio(whisper_dir).features(samples, rate)


def test_a_checkpoint_without_a_whisper_preprocessor_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"preprocessor_config\.json is missing"):
        WhisperAudio(tmp_path)
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({"feature_extractor_type": "Wav2Vec2FeatureExtractor"}))
    with pytest.raises(ValueError, match="does not describe a WhisperFeatureExtractor "
                                         r"\(its feature_extractor_type is 'Wav2Vec2"):
        WhisperAudio(tmp_path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="could not be read as JSON"):
        WhisperAudio(tmp_path)
