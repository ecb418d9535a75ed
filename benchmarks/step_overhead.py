"""Host-side cost of one engine step with the model left out.

Keeps 256 requests running (max_model_len 2048, block size 16, a 2048-token step budget):
each finished request is replaced by a new one with a long prompt, so a steady step is
about 250 decodes plus one or two chunked prefills. Each step runs what the engine does
around the forward pass:

- scheduler: `Scheduler.schedule()` and `Scheduler.update_from_output()` fed one fake
  sampled token per request whose prompt is done;
- prepare_inputs: the runner applying the `SchedulerOutput` to its persistent
  `InputBatch` (`ModelRunner._update_states`, run on a runner that owns no model),
  `prepare_inputs`, and recording the sampled tokens in the batch.

Attention and sampling metadata (host work too, but outside the target) are timed
separately. The last line printed is one JSON object with the figures.

    python benchmarks/step_overhead.py [--steps 300] [--warmup-steps 300] [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvferry.engine.config import CacheConfig, SchedulerConfig
from kvferry.engine.core.kv_cache import KVCacheManager
from kvferry.engine.core.request import Request
from kvferry.engine.runner.input_batch import InputBatch
from kvferry.engine.runner.model_runner import ModelRunner
from kvferry.engine.runner.prepare_inputs import InputBuffers, PreparedInputs, prepare_inputs
from kvferry.engine.sample.sampler import SamplerOutput
from kvferry.engine.sampling_params import SamplingParams
from kvferry.engine.core.scheduler import Scheduler
from kvferry.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

TARGET_MS = 1.0
MAX_NUM_SEQS = 256
MAX_MODEL_LEN = 2048
BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 2048
VOCAB_SIZE = 32000
# Room for every request at full length, plus the null block.
NUM_BLOCKS = MAX_NUM_SEQS * (MAX_MODEL_LEN // BLOCK_SIZE) + 1
PROMPT_LEN_RANGE = (256, 1536)
OUTPUT_LEN_RANGE = (64, 512)


@dataclass
class StepTimes:
    """Milliseconds per measured step, by phase."""

    schedule: list[float] = field(default_factory=list)
    update: list[float] = field(default_factory=list)
    runner_update: list[float] = field(default_factory=list)
    prepare: list[float] = field(default_factory=list)
    record: list[float] = field(default_factory=list)
    metadata: list[float] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_prefills: list[int] = field(default_factory=list)

    def scheduler(self) -> list[float]:
        return [a + b for a, b in zip(self.schedule, self.update)]

    def runner(self) -> list[float]:
        return [a + b + c for a, b, c in zip(self.runner_update, self.prepare, self.record)]

    def total(self) -> list[float]:
        return [a + b for a, b in zip(self.scheduler(), self.runner())]


class RequestSource:
    """New requests from a fixed seed: random prompts, uniform prompt and output lengths."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.count = 0

    def next(self) -> Request:
        prompt_len = int(self.rng.integers(PROMPT_LEN_RANGE[0], PROMPT_LEN_RANGE[1] + 1))
        output_len = int(self.rng.integers(OUTPUT_LEN_RANGE[0], OUTPUT_LEN_RANGE[1] + 1))
        prompt = self.rng.integers(3, VOCAB_SIZE, prompt_len).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        self.count += 1
        return Request(str(self.count), prompt, params, eos_token_ids=(2,))


class HostRunner:
    """The model runner's host side: persistent batch, input buffers, no model or KV tensor."""

    def __init__(self) -> None:
        # The runner's own `_update_states` and `_record_samples` run on this object, so
        # it carries exactly the attributes they read.
        runner = ModelRunner.__new__(ModelRunner)
        runner.device = torch.device("cpu")
        runner.block_size = BLOCK_SIZE
        runner.input_batch = InputBatch(MAX_NUM_SEQS, MAX_MODEL_LEN, BLOCK_SIZE, runner.device)
        runner.buffers = InputBuffers.allocate(MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS)
        runner.requests = {}
        runner.arch = _ArchStub(VOCAB_SIZE)
        self.runner = runner

    def update_states(self, so: SchedulerOutput) -> None:
        self.runner._update_states(so)

    def prepare(self, so: SchedulerOutput) -> PreparedInputs:
        """The host arithmetic of `ModelRunner.execute_model` before the forward pass."""
        batch = self.runner.input_batch
        req_ids = batch.active_req_ids
        num_scheduled = np.fromiter(
            (so.num_scheduled_tokens[r] for r in req_ids), np.int64, len(req_ids)
        )
        return prepare_inputs(
            num_scheduled, batch.num_computed_tokens, batch.num_tokens, batch.token_ids.np,
            batch.block_table.np, BLOCK_SIZE, self.runner.buffers,
        )

    def build_metadata(self, prepared: PreparedInputs, so: SchedulerOutput) -> None:
        """Attention and sampling metadata, as the runner builds them around the model."""
        self.runner._attention_metadata(prepared)
        rows = prepared.sampled_rows.tolist()
        if rows:
            self.runner._sampling_metadata(rows, so)

    def record(self, prepared: PreparedInputs) -> ModelRunnerOutput:
        """Stores one fake sampled token per finished row, as after the sampler."""
        rows = prepared.sampled_rows.tolist()
        if not rows:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        # Token id derived from the position, so rows differ and prefix hashes stay distinct.
        fake = torch.from_numpy(prepared.positions[prepared.logits_indices] % VOCAB_SIZE)
        return self.runner._record_samples(rows, SamplerOutput(fake, None))


@dataclass
class _ArchStub:
    """The one architecture field the sampling metadata reads."""

    vocab_size: int


def make_scheduler() -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=MAX_MODEL_LEN,
    )
    cache = CacheConfig(block_size=BLOCK_SIZE)
    manager = KVCacheManager(NUM_BLOCKS, cache.block_size, cache.enable_prefix_caching)
    return Scheduler(config, manager)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - start) * 1e3


def run_step(
    scheduler: Scheduler, runner: HostRunner, source: RequestSource, times: StepTimes | None
) -> None:
    """One step; keeps MAX_NUM_SEQS requests in the system by replacing finished ones."""
    while scheduler.get_num_unfinished_requests() < MAX_NUM_SEQS:
        scheduler.add_request(source.next())
    so, t_schedule = _timed(scheduler.schedule)
    _, t_runner_update = _timed(lambda: runner.update_states(so))
    prepared, t_prepare = _timed(lambda: runner.prepare(so))
    _, t_metadata = _timed(lambda: runner.build_metadata(prepared, so))
    runner_output, t_record = _timed(lambda: runner.record(prepared))
    _, t_update = _timed(lambda: scheduler.update_from_output(so, runner_output))
    if times is None:
        return
    times.schedule.append(t_schedule)
    times.update.append(t_update)
    times.runner_update.append(t_runner_update)
    times.prepare.append(t_prepare)
    times.record.append(t_record)
    times.metadata.append(t_metadata)
    times.num_tokens.append(so.total_num_scheduled_tokens)
    times.num_prefills.append(sum(1 for n in so.num_scheduled_tokens.values() if n > 1))


def describe(name: str, values: list[float]) -> str:
    return (f"{name:<40} mean {statistics.fmean(values):7.3f} ms   "
            f"median {statistics.median(values):7.3f} ms   p90 {np.percentile(values, 90):7.3f} ms")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup-steps", type=int, default=300,
                        help="steps before measuring: the initial prefills, then steady state")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true",
                        help="print a cProfile of the measured steps (slows them down)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    scheduler, runner, source = make_scheduler(), HostRunner(), RequestSource(args.seed)
    for _ in range(args.warmup_steps):
        run_step(scheduler, runner, source, None)
    times = StepTimes()
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    for _ in range(args.steps):
        run_step(scheduler, runner, source, times)
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)

    total = times.total()
    print(f"{args.steps} steps after {args.warmup_steps} warm-up steps; "
          f"{len(scheduler.running)} running, {len(scheduler.waiting)} waiting; "
          f"{statistics.fmean(times.num_tokens):.0f} tokens and "
          f"{statistics.fmean(times.num_prefills):.1f} prefill chunks per step on average")
    print(describe("schedule()", times.schedule))
    print(describe("update_from_output()", times.update))
    print(describe("runner: apply SchedulerOutput", times.runner_update))
    print(describe("runner: prepare_inputs", times.prepare))
    print(describe("runner: record sampled tokens", times.record))
    print(describe("scheduler total", times.scheduler()))
    print(describe("runner total", times.runner()))
    print(describe("step total", total))
    print(describe("(not in total) attn + sampling metadata", times.metadata))
    ms_per_step = statistics.fmean(total)
    print(f"target <= {TARGET_MS} ms per step: {'met' if ms_per_step <= TARGET_MS else 'missed'} "
          f"({TARGET_MS / ms_per_step:.2f}x)")
    print(json.dumps({
        "ms_per_step": round(ms_per_step, 4),
        "median_ms_per_step": round(statistics.median(total), 4),
        "scheduler_ms": round(statistics.fmean(times.scheduler()), 4),
        "prepare_inputs_ms": round(statistics.fmean(times.runner()), 4),
        "metadata_ms": round(statistics.fmean(times.metadata), 4),
        "target_ms": TARGET_MS,
        "ratio": round(TARGET_MS / ms_per_step, 4),
        "steps": args.steps,
        "num_running": MAX_NUM_SEQS,
    }))


if __name__ == "__main__":
    main()
