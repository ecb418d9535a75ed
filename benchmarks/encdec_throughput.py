"""Encoder-decoder throughput: transcription requests per second of kvferry against HF.

Builds a Whisper-shaped random-weight checkpoint (whisper-tiny's sizes: 4 + 4 layers of
384 with 6 heads, 80 mel bins, 30 s windows of 1,500 encoder positions; a vocabulary of
1,536, what the locally trained tokenizer reaches) with its tokenizer and feature
extractor in a temporary directory, then runs one workload through both:

- HF transformers: the checkpoint's `WhisperFeatureExtractor` on each static batch, then
  `generate` (greedy, EOS disabled) from the usual decoder prompt (start of transcript,
  language, task, no timestamps) on the batch's features, each batch decoding as many
  tokens as its longest request asks for; only the tokens each request asked for count.
- kvferry `LLM.generate` with the audio as the encoder prompt (features computed by the
  front end), continuous batching, the encoder under its own budget, per-request
  `max_tokens`.

The workload: requests of 5-30 s of synthetic audio (tones and noise) and transcripts of
64-128 tokens. The baseline is HF at its fastest batch size. The last line printed is one
JSON object with the figures; `ratio` is kvferry's requests/s over HF's.

    python benchmarks/encdec_throughput.py [--num-requests 32] [--hf-batch-size 8 16 32]
    python benchmarks/encdec_throughput.py --quick      # a tiny model: a smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from kvferry_testing.encdec_checkpoints import (  # noqa: E402
    make_whisper_checkpoint,
    whisper_decoder_prompt,
)

TARGET_RATIO = 3.0
SAMPLING_RATE = 16000


@dataclass(frozen=True)
class Shape:
    d_model: int
    layers: int
    heads: int
    ffn: int
    vocab_size: int
    num_mel_bins: int
    max_source_positions: int
    max_target_positions: int

    @property
    def max_seconds(self) -> int:
        return self.max_source_positions // 50


FULL_SHAPE = Shape(384, 4, 6, 1536, 1536, 80, 1500, 448)
QUICK_SHAPE = Shape(64, 2, 4, 128, 512, 16, 100, 64)


@dataclass(frozen=True)
class Workload:
    clips: list[np.ndarray]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True)
class RunResult:
    seconds: float
    outputs: list[list[int]]

    def requests_per_s(self) -> float:
        return len(self.outputs) / self.seconds


def synthetic_clip(rng: np.random.Generator, seconds: float) -> np.ndarray:
    """A few tones with a wandering pitch and some noise: speech-like enough for features."""
    t = np.arange(int(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    clip = 0.02 * rng.standard_normal(t.shape)
    for _ in range(3):
        base = rng.uniform(80, 1200)
        wobble = rng.uniform(0.5, 4.0)
        clip += rng.uniform(0.05, 0.3) * np.sin(2 * np.pi * base * t
                                                + 3 * np.sin(2 * np.pi * wobble * t))
    return clip.astype(np.float32)


def make_workload(num_requests: int, seconds: tuple[float, float], lens: tuple[int, int],
                  seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    clips = [synthetic_clip(rng, float(rng.uniform(*seconds))) for _ in range(num_requests)]
    output_lens = rng.integers(lens[0], lens[1] + 1, num_requests).tolist()
    return Workload(clips, [int(n) for n in output_lens])


def build_checkpoint(path: Path, shape: Shape, seed: int) -> Path:
    return make_whisper_checkpoint(
        path, seed, d_model=shape.d_model, encoder_layers=shape.layers,
        decoder_layers=shape.layers, encoder_attention_heads=shape.heads,
        decoder_attention_heads=shape.heads, encoder_ffn_dim=shape.ffn,
        decoder_ffn_dim=shape.ffn, vocab_size=shape.vocab_size,
        num_mel_bins=shape.num_mel_bins, max_source_positions=shape.max_source_positions,
        max_target_positions=shape.max_target_positions)


# ---------------------------------------------------------------------- HF baseline
def hf_generate_batch(model: Any, extractor: Any, clips: list[np.ndarray],
                      prompt: list[int], max_new_tokens: int) -> list[list[int]]:
    """Features of a static batch, then greedy `generate` from the decoder prompt."""
    from transformers import GenerationMixin

    features = extractor(clips, sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features
    config = copy.deepcopy(model.generation_config)
    for name in ("forced_decoder_ids", "suppress_tokens", "begin_suppress_tokens"):
        setattr(config, name, None)
    config.do_sample, config.num_beams = False, 1
    config.max_new_tokens = config.min_new_tokens = max_new_tokens
    config.max_length = None
    config.eos_token_id = []
    decoder_ids = torch.tensor([prompt] * len(clips))
    with torch.inference_mode():
        # The plain generation loop of transformers (Whisper's own `generate` adds
        # long-form and language-detection logic around it).
        out = GenerationMixin.generate(model, input_features=features,
                                       decoder_input_ids=decoder_ids, generation_config=config)
    return out[:, len(prompt):].tolist()


def run_hf(model: Any, extractor: Any, workload: Workload, prompt: list[int],
           batch_size: int) -> RunResult:
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(workload.clips), batch_size):
        clips = workload.clips[first:first + batch_size]
        lens = workload.output_lens[first:first + batch_size]
        generated = hf_generate_batch(model, extractor, clips, prompt, max(lens))
        outputs.extend(ids[:n] for ids, n in zip(generated, lens))
    return RunResult(time.perf_counter() - start, outputs)


def measure_hf(path: Path, workload: Workload, warmup: Workload, prompt: list[int],
               batch_sizes: list[int]) -> dict[int, RunResult]:
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    extractor = WhisperFeatureExtractor.from_pretrained(path)
    run_hf(model, extractor, warmup, prompt, len(warmup.clips))
    return {b: run_hf(model, extractor, workload, prompt, b) for b in batch_sizes}


# ---------------------------------------------------------------------- kvferry
def make_llm(path: Path, shape: Shape, max_num_seqs: int) -> Any:
    from kvferry import LLM

    return LLM(model=str(path), dtype="float32", device="cpu",
               max_model_len=shape.max_target_positions, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=2048)


def time_encoders(llm: Any, workload: Workload) -> float:
    """Seconds kvferry takes to run only the encoders of the workload (LLM.encode, from an
    empty prefix cache): the part of the work that is the same in both engines."""
    if not llm.llm_engine.engine_core.kv_cache_manager.reset_prefix_cache():
        raise RuntimeError("blocks still in use after a run")
    prompts = [{"multi_modal_data": {"audio": (clip, SAMPLING_RATE)}} for clip in workload.clips]
    start = time.perf_counter()
    llm.encode(prompts)
    return time.perf_counter() - start


def run_kvferry(llm: Any, workload: Workload) -> RunResult:
    from kvferry import SamplingParams

    prompts = [{"encoder_prompt": {"multi_modal_data": {"audio": (clip, SAMPLING_RATE)}},
                "decoder_prompt": None} for clip in workload.clips]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in workload.output_lens]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return RunResult(seconds, [list(r.outputs[0].token_ids) for r in results])


# ---------------------------------------------------------------------- report
def check_lengths(name: str, result: RunResult, workload: Workload) -> None:
    got = [len(o) for o in result.outputs]
    if got != workload.output_lens:
        raise RuntimeError(f"{name}: output lengths {got} differ from {workload.output_lens}")


def agreement(a: RunResult, b: RunResult) -> tuple[int, float]:
    """(requests with identical outputs, mean fraction of leading tokens that agree)."""
    identical, fractions = 0, []
    for x, y in zip(a.outputs, b.outputs):
        identical += x == y
        common = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        fractions.append(common / max(len(x), 1))
    return identical, float(np.mean(fractions))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--hf-batch-size", type=int, nargs="+", default=[8, 16, 32],
                        help="HF static batch sizes; the fastest is the baseline")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model and workload: a smoke run of a few seconds")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    num_requests = min(args.num_requests, 6) if args.quick else args.num_requests
    seconds = (0.5, float(shape.max_seconds)) if args.quick else (5.0, 30.0)
    lens = (4, 12) if args.quick else (64, 128)
    workload = make_workload(num_requests, seconds, lens, args.seed)
    warmup = make_workload(2, seconds, (2, 4), args.seed + 1)
    batch_sizes = [b for b in args.hf_batch_size if b <= num_requests] or [num_requests]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"model: {shape}")
    print(f"workload: {num_requests} requests, {sum(len(c) for c in workload.clips) / 16000:.0f}"
          f" s of audio, {workload.num_output_tokens} output tokens")
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "whisper", shape, args.seed)
        prompt = whisper_decoder_prompt(path)
        llm = make_llm(path, shape, args.max_num_seqs)
        run_kvferry(llm, warmup)
        if not llm.llm_engine.engine_core.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("blocks still in use after the warmup")
        kvferry = run_kvferry(llm, workload)
        check_lengths("kvferry", kvferry, workload)
        encoder_s = time_encoders(llm, workload)
        del llm
        print(f"kvferry: {kvferry.seconds:.2f} s, {kvferry.requests_per_s():.3f} requests/s, "
              f"{workload.num_output_tokens / kvferry.seconds:.1f} output tokens/s")
        hf_runs = measure_hf(path, workload, warmup, prompt, batch_sizes)
    for batch_size, run in hf_runs.items():
        check_lengths("hf", run, workload)
        print(f"hf generate (static batches of {batch_size}): {run.seconds:.2f} s, "
              f"{run.requests_per_s():.3f} requests/s")
    best = min(hf_runs, key=lambda b: hf_runs[b].seconds)
    ratio = kvferry.requests_per_s() / hf_runs[best].requests_per_s()
    identical, prefix = agreement(kvferry, hf_runs[best])
    # The encoders are the same computation in both (30 s windows of 1,500 positions through
    # the same layers): with HF's encoders taken to cost what kvferry's do, this is the
    # ratio of everything else (decoding, batching, overheads), and ratio's ceiling is
    # hf_seconds / encoder_seconds.
    rest_ratio = (hf_runs[best].seconds - encoder_s) / max(kvferry.seconds - encoder_s, 1e-9)
    print(f"kvferry's encoders alone: {encoder_s:.2f} s ({encoder_s / kvferry.seconds:.0%} of "
          f"its run); the rest: {rest_ratio:.2f}x faster than HF's; the ratio can be at most "
          f"{hf_runs[best].seconds / encoder_s:.2f} with encoders of equal cost")
    print(f"greedy agreement: {identical}/{num_requests} requests identical, {prefix:.1%} of "
          "tokens before the first difference")
    print(f"ratio kvferry / hf (requests/s, hf batch {best}): {ratio:.2f} "
          f"(target >= {TARGET_RATIO})")
    print(json.dumps({
        "num_requests": num_requests,
        "audio_seconds": round(sum(len(c) for c in workload.clips) / SAMPLING_RATE, 1),
        "output_tokens": workload.num_output_tokens,
        "kvferry_seconds": round(kvferry.seconds, 3),
        "kvferry_requests_per_s": round(kvferry.requests_per_s(), 4),
        "hf_seconds": round(hf_runs[best].seconds, 3),
        "hf_requests_per_s": round(hf_runs[best].requests_per_s(), 4),
        "hf_batch_size": best,
        "hf_requests_per_s_by_batch_size": {
            b: round(r.requests_per_s(), 4) for b, r in hf_runs.items()},
        "ratio": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "identical_outputs": identical,
        "kvferry_encoder_seconds": round(encoder_s, 3),
        "ratio_excluding_encoders": round(rest_ratio, 3),
        "ratio_ceiling": round(hf_runs[best].seconds / encoder_s, 3),
    }))


if __name__ == "__main__":
    main()
