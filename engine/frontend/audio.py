"""Audio for Whisper: an uploaded file decoded to mono samples, resampled to the model's rate
and turned into the log-mel features its encoder reads.

WAV files in the common encodings (PCM of 8, 16, 24 or 32 bits, IEEE float of 32 or 64) are
read here with NumPy; FLAC, OGG and the rarer WAV encodings (mu-law, A-law, ADPCM, RF64) go
through libsndfile (the `soundfile` package). A file is recognized by its first bytes, never
by its name or the client's content type. Every refusal is a ValueError whose message a
client can act on.
"""

from __future__ import annotations

import io
import json
import math
import struct
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from transformers import WhisperFeatureExtractor

# What a client may send, as said in refusals.
SUPPORTED_FORMATS = "WAV, FLAC or OGG"
# Sample rates outside these bounds are refused: below, no speech survives; above, the
# resampling filter grows with the rate for no benefit.
MIN_SAMPLE_RATE = 1_000
MAX_SAMPLE_RATE = 384_000
# The resampling ratio as a fraction with at most this denominator. Every common rate
# (8, 11.025, 16, 22.05, 32, 44.1, 48, 96 kHz...) reduces exactly below it (44.1 kHz -> 16 kHz
# is 160/441); an odd rate is approximated within a few parts per million, which changes
# nothing audible, where its exact ratio could need a filter of millions of taps.
MAX_RESAMPLE_DENOMINATOR = 1024

# WAV encodings (the fmt chunk's format tag) read here; others go to libsndfile.
_WAVE_FORMAT_PCM = 1
_WAVE_FORMAT_IEEE_FLOAT = 3
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE
# (format tag, bits per sample) -> NumPy dtype of one sample, little-endian. 24-bit PCM has
# no dtype: its samples are assembled from bytes.
_WAV_DTYPES = {
    (_WAVE_FORMAT_PCM, 8): np.dtype(np.uint8),
    (_WAVE_FORMAT_PCM, 16): np.dtype("<i2"),
    (_WAVE_FORMAT_PCM, 32): np.dtype("<i4"),
    (_WAVE_FORMAT_IEEE_FLOAT, 32): np.dtype("<f4"),
    (_WAVE_FORMAT_IEEE_FLOAT, 64): np.dtype("<f8"),
}


@dataclass(frozen=True)
class _WavFormat:
    """A WAV file's fmt chunk, as far as decoding needs it."""

    format_tag: int  # 1: integer PCM, 3: IEEE float (the sub-format of an extensible file)
    num_channels: int
    sample_rate: int
    bits_per_sample: int
    # Bytes of one frame (one sample of every channel).
    block_align: int

    @property
    def is_native(self) -> bool:
        """Whether NumPy reads it here (else libsndfile does)."""
        return ((self.format_tag, self.bits_per_sample) in _WAV_DTYPES
                or (self.format_tag, self.bits_per_sample) == (_WAVE_FORMAT_PCM, 24))


def decode_audio(data: bytes, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """Mono float32 samples in [-1, 1] and the file's sample rate.

    Channels are averaged. With `max_seconds`, a longer file is refused from its header,
    before its samples are decoded. ValueError says why a file cannot be used: not a WAV,
    FLAC or OGG file, damaged, empty, no samples, an unsupported rate, too long.
    """
    if not data:
        raise ValueError("the file is empty")
    container = _container(data)
    if container == "WAV":
        wav_format, body = _parse_wav(data)
        if wav_format.is_native:
            return _decode_native_wav(wav_format, body, max_seconds)
    return _decode_with_soundfile(data, container, max_seconds)


def _container(data: bytes) -> str:
    """ "WAV", "FLAC" or "OGG", from the file's first bytes."""
    if data[:4] in (b"RIFF", b"RF64", b"BW64") and data[8:12] == b"WAVE":
        return "WAV"
    if data[:4] == b"fLaC":
        return "FLAC"
    if data[:4] == b"OggS":
        return "OGG"
    raise ValueError(f"the file is not a {SUPPORTED_FORMATS} file (its first bytes are none "
                     "of theirs)")


def _parse_wav(data: bytes) -> tuple[_WavFormat, memoryview]:
    """The fmt chunk and the bytes of the data chunk of a RIFF/WAVE file.

    Chunks follow the 12-byte header: a 4-byte id, a 4-byte little-endian size, the body,
    and a pad byte when the size is odd. A data chunk whose size runs past the end of the
    file (as written by a recorder that never went back to fix it) is cut to what is there.
    """
    view = memoryview(data)
    wav_format: _WavFormat | None = None
    pos = 12
    while pos + 8 <= len(data):
        chunk_id = bytes(view[pos:pos + 4])
        size = int.from_bytes(view[pos + 4:pos + 8], "little")
        start, end = pos + 8, min(pos + 8 + size, len(data))
        if chunk_id == b"fmt ":
            wav_format = _parse_fmt(view[start:end])
        elif chunk_id == b"data":
            if wav_format is None:
                raise ValueError("the WAV file is damaged: its data chunk comes before its fmt "
                                 "chunk")
            return wav_format, view[start:end]
        pos = start + size + (size & 1)
    missing = "fmt" if wav_format is None else "data"
    raise ValueError(f"the WAV file is damaged: it has no {missing} chunk")


def _parse_fmt(body: memoryview) -> _WavFormat:
    if len(body) < 16:
        raise ValueError("the WAV file is damaged: its fmt chunk is too short")
    tag, channels, rate, _, block_align, bits = struct.unpack("<HHIIHH", body[:16])
    if tag == _WAVE_FORMAT_EXTENSIBLE and len(body) >= 26:
        # The sub-format GUID begins with the plain format tag.
        tag = int.from_bytes(body[24:26], "little")
    if channels == 0:
        raise ValueError("the WAV file is damaged: its fmt chunk says 0 channels")
    wav_format = _WavFormat(tag, channels, rate, bits, block_align)
    if wav_format.is_native and block_align != channels * bits // 8:
        raise ValueError(f"the WAV file is damaged: {channels} channels of {bits} bits need "
                         f"frames of {channels * bits // 8} bytes, its fmt chunk says "
                         f"{block_align}")
    return wav_format


def _decode_native_wav(wav_format: _WavFormat, body: memoryview,
                       max_seconds: float | None) -> tuple[np.ndarray, int]:
    rate = wav_format.sample_rate
    _check_rate(rate)
    num_frames = len(body) // wav_format.block_align
    _check_length(num_frames, rate, max_seconds)
    raw = body[:num_frames * wav_format.block_align]
    key = (wav_format.format_tag, wav_format.bits_per_sample)
    if key == (_WAVE_FORMAT_PCM, 24):
        samples = _pcm24(raw)
    else:
        samples = _scaled(np.frombuffer(raw, dtype=_WAV_DTYPES[key]))
    # (num_frames * num_channels,) -> (num_frames, num_channels) -> mono
    return _mono(samples.reshape(num_frames, wav_format.num_channels)), rate


def _scaled(values: np.ndarray) -> np.ndarray:
    """Integer PCM to [-1, 1) as float32 (8-bit WAV is unsigned around 128); floats as is."""
    if values.dtype == np.uint8:
        return (values.astype(np.float32) - 128.0) / 128.0
    if values.dtype.kind == "i":
        return values.astype(np.float32) / float(2 ** (8 * values.dtype.itemsize - 1))
    return values.astype(np.float32)


def _pcm24(raw: memoryview) -> np.ndarray:
    """24-bit little-endian PCM to float32: three bytes per sample, sign-extended."""
    octets = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
    values = octets[:, 0] | (octets[:, 1] << 8) | (octets[:, 2] << 16)
    values = (values << 8) >> 8  # the top byte's sign bit fills the upper 8 bits
    return values.astype(np.float32) / float(2 ** 23)


def _decode_with_soundfile(data: bytes, container: str,
                           max_seconds: float | None) -> tuple[np.ndarray, int]:
    import soundfile

    try:
        with soundfile.SoundFile(io.BytesIO(data)) as sound:
            rate = int(sound.samplerate)
            _check_rate(rate)
            _check_length(sound.frames, rate, max_seconds)
            # The header's frame count may be wrong: read at most one frame past the limit.
            limit = -1 if max_seconds is None else math.floor(max_seconds * rate) + 1
            frames = sound.read(frames=limit, dtype="float32", always_2d=True)
    except soundfile.SoundFileError as exc:
        reason = getattr(exc, "error_string", None) or str(exc)
        raise ValueError(f"the {container} file could not be decoded: {reason}") from None
    _check_length(len(frames), rate, max_seconds)
    return _mono(frames), rate


def _mono(frames: np.ndarray) -> np.ndarray:
    """(num_frames, num_channels) float32 -> (num_frames,), channels averaged, in [-1, 1]."""
    if frames.shape[0] == 0:
        raise ValueError("the file has no samples")
    if not np.isfinite(frames).all():
        raise ValueError("the file holds samples that are not finite numbers")
    samples = frames[:, 0] if frames.shape[1] == 1 else frames.mean(axis=1, dtype=np.float32)
    return np.clip(samples, -1.0, 1.0).astype(np.float32, copy=False)


def _check_rate(rate: int) -> None:
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise ValueError(f"the audio's sample rate of {rate} Hz is outside the supported range "
                         f"of {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz")


def _check_length(num_samples: int, rate: int, max_seconds: float | None) -> None:
    if max_seconds is not None and num_samples > max_seconds * rate:
        raise ValueError(f"the audio lasts {num_samples / rate:.2f} s, longer than the "
                         f"{max_seconds:g} s this model takes")


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """`samples` at `to_rate`, float32: a polyphase low-pass resampler, so that frequencies
    above the new Nyquist rate are filtered out instead of folding back into the signal."""
    if from_rate == to_rate:
        return samples.astype(np.float32, copy=False)
    from scipy.signal import resample_poly

    ratio = Fraction(to_rate, from_rate).limit_denominator(MAX_RESAMPLE_DENOMINATOR)
    out = resample_poly(samples, ratio.numerator, ratio.denominator)
    return np.asarray(out, dtype=np.float32)


class WhisperAudio:
    """A Whisper checkpoint's audio front end: its `WhisperFeatureExtractor`, built from the
    checkpoint's `preprocessor_config.json` (never downloaded)."""

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "preprocessor_config.json"
        self._extractor = _load_extractor(path)
        # The rate the features are computed at (16 kHz for every Whisper).
        self.sampling_rate = int(self._extractor.sampling_rate)
        # The longest audio one request may hold: the extractor's chunk (30 s), which it
        # pads every input to.
        self.max_seconds = float(self._extractor.chunk_length)
        self.num_mel_bins = int(self._extractor.feature_size)
        # Feature frames of every input (the chunk over the hop: 3,000).
        self.num_frames = int(self._extractor.nb_max_frames)

    def prepare(self, samples: np.ndarray, sample_rate: int) -> np.ndarray:
        """The samples at `sampling_rate`, float32, checked: one channel, finite, not empty,
        no longer than `max_seconds`; ValueError says which check failed."""
        samples = np.asarray(samples)
        if samples.ndim != 1:
            raise ValueError(f"audio samples must be one channel (a 1-D array), got shape "
                             f"{samples.shape}")
        if samples.dtype.kind not in "fiu":
            raise ValueError(f"audio samples must be numbers, got dtype {samples.dtype}")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
            raise ValueError(f"the sample rate must be an integer, got {sample_rate!r}")
        _check_rate(int(sample_rate))
        if samples.size == 0:
            raise ValueError("the audio has no samples")
        _check_length(samples.size, int(sample_rate), self.max_seconds)
        samples = samples.astype(np.float32, copy=False)
        if not np.isfinite(samples).all():
            raise ValueError("the audio holds samples that are not finite numbers")
        out = resample(samples, int(sample_rate), self.sampling_rate)
        # Rounding may add a sample past the chunk to audio of exactly max_seconds.
        return out[:round(self.max_seconds * self.sampling_rate)]

    def features(self, samples: np.ndarray, sample_rate: int) -> np.ndarray:
        """Log-mel features, (num_mel_bins, num_frames) float32, of mono `samples` at any
        supported rate; ValueError when they are empty, too long or not audio."""
        prepared = self.prepare(samples, sample_rate)
        out = self._extractor(prepared, sampling_rate=self.sampling_rate, return_tensors="np")
        # (1, num_mel_bins, num_frames) -> (num_mel_bins, num_frames)
        return np.asarray(out["input_features"][0], dtype=np.float32)


def _load_extractor(path: Path) -> WhisperFeatureExtractor:
    if not path.is_file():
        raise ValueError(f"{path} is missing: a Whisper checkpoint needs it to turn audio into "
                         "features")
    try:
        config: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} could not be read as JSON: {exc}") from None
    kind = config.get("feature_extractor_type") if isinstance(config, dict) else None
    if kind != "WhisperFeatureExtractor":
        raise ValueError(f"{path} does not describe a WhisperFeatureExtractor "
                         f"(its feature_extractor_type is {kind!r})")
    try:
        from transformers import WhisperFeatureExtractor
    except ImportError:
        raise ValueError("serving Whisper needs the transformers package (its feature "
                         "extractor): pip install 'kvferry[whisper]'") from None
    try:
        extractor = WhisperFeatureExtractor.from_dict(config)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path} does not make a WhisperFeatureExtractor: {exc}") from None
    if not (extractor.sampling_rate > 0 and extractor.chunk_length > 0):
        raise ValueError(f"{path} must give a positive sampling_rate and chunk_length")
    return extractor
