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
separately.

Then the same workload runs twice more against a simulated device, whose every step takes
`--device-ms` (default: the synchronous host step just measured, where overlap matters
most) and runs beside the host as a GPU does: once in the synchronous loop (the host waits
for each step's tokens, then schedules and prepares the next: host time adds to every
step) and once with async scheduling (step N+1 is scheduled, prepared and launched before
step N's tokens are read back: the output placeholders, the fill of the inputs from the
previous step's sampled tensor and the deferred host writes all run). Printed: the host
work per step in each loop, the wall time per step, the device's idle time per step, and
the ratio. The last line printed is one JSON object with the figures.

    python benchmarks/step_overhead.py [--steps 300] [--warmup-steps 300] [--device-ms MS]
                                       [--profile]
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
from kvferry.engine.core.scheduler import Scheduler
from kvferry.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvferry.engine.runner.async_output import AsyncModelRunnerOutput, PendingTokens
from kvferry.engine.runner.input_batch import InputBatch
from kvferry.engine.runner.model_runner import ModelRunner
from kvferry.engine.runner.prepare_inputs import InputBuffers, PreparedInputs, prepare_inputs
from kvferry.engine.runner.step_staging import StepStaging
from kvferry.engine.sample.sampler import SamplerOutput
from kvferry.engine.sampling_params import SamplingParams

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
        runner.staging = StepStaging(MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, runner.device)
        runner.requests = {}
        runner._scoring_prompts = set()
        runner.pending = PendingTokens(runner.input_batch)
        runner._sampling_uploads = None
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
        runner = self.runner
        runner._attention_metadata(prepared, runner.staging.stage(prepared))
        rows = prepared.sampled_rows.tolist()
        if rows:
            runner._sampling_metadata(self._states(rows), so, None)

    def record(self, prepared: PreparedInputs) -> ModelRunnerOutput:
        """Stores one fake sampled token per finished row, as after the sampler."""
        rows = prepared.sampled_rows.tolist()
        if not rows:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        return self.runner._record_samples(rows, self._states(rows), _fake_samples(prepared))

    # ---------------------------------------------------------------- async scheduling
    def launch(self, so: SchedulerOutput) -> AsyncModelRunnerOutput:
        """The host side of `ModelRunner.execute_model_async`: the batch updated, inputs
        prepared, the placeholders among them filled from the previous step's sampled
        tensor, and the step's fake samples left pending."""
        runner = self.runner
        runner._update_states(so)
        prepared = self.prepare(so)
        staged = runner.staging.stage(prepared)
        runner.pending.fill_inputs(staged.input_ids, prepared.input_ids,
                                   prepared.query_start_loc)
        rows = prepared.sampled_rows.tolist()
        if not rows:
            return AsyncModelRunnerOutput.ready(ModelRunnerOutput(req_ids=[],
                                                                  sampled_token_ids=[]))
        return runner.pending.defer(self._states(rows), rows, _fake_samples(prepared), {})

    def _states(self, rows: list[int]) -> list:
        return list(map(self.runner.input_batch.states.__getitem__, rows))


def _fake_samples(prepared: PreparedInputs) -> SamplerOutput:
    # Token id derived from the position, so rows differ and prefix hashes stay distinct.
    return SamplerOutput(
        torch.from_numpy(prepared.positions[prepared.logits_indices] % VOCAB_SIZE), None)


@dataclass
class _ArchStub:
    """The one architecture field the sampling metadata reads."""

    vocab_size: int


def make_scheduler(async_scheduling: bool = False) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        async_scheduling=async_scheduling,
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


class SimulatedDevice:
    """A device that runs each launched step for `step_ms`, in launch order, beside the
    host (as a GPU stream does): `launch` returns at once, `wait` blocks until the step is
    done. Counts the time it sits idle between steps."""

    def __init__(self, step_ms: float) -> None:
        self.step_s = step_ms / 1e3
        self.busy_until = 0.0
        self.idle_s = 0.0

    def launch(self) -> float:
        """Queues a step; returns when it will be done."""
        now = time.perf_counter()
        if self.busy_until < now:  # the device ran dry: it waited for the host
            self.idle_s += now - self.busy_until if self.busy_until else 0.0
            self.busy_until = now
        self.busy_until += self.step_s
        return self.busy_until

    def wait(self, done_at: float) -> float:
        """Blocks until `done_at`; returns the seconds waited. Spins for the last
        millisecond: a sleep's late wake-up would count as the host's time."""
        start = time.perf_counter()
        if done_at - start > 2e-3:
            time.sleep(done_at - start - 1e-3)
        while time.perf_counter() < done_at:
            pass
        return time.perf_counter() - start


@dataclass
class LoopTimes:
    """One loop against the simulated device."""

    wall_s: float
    host_s: float  # wall time minus the time spent waiting for the device
    device_idle_s: float
    steps: int

    def per_step_ms(self, seconds: float) -> float:
        return seconds / self.steps * 1e3


def run_sync_loop(num_steps: int, warmup_steps: int, seed: int, device_ms: float) -> LoopTimes:
    """The synchronous loop: launch, wait for the tokens, update, schedule the next."""
    scheduler, runner, source = make_scheduler(), HostRunner(), RequestSource(seed)
    for _ in range(warmup_steps):
        run_step(scheduler, runner, source, None)
    device = SimulatedDevice(device_ms)
    waited = 0.0
    start = time.perf_counter()
    for _ in range(num_steps):
        while scheduler.get_num_unfinished_requests() < MAX_NUM_SEQS:
            scheduler.add_request(source.next())
        so = scheduler.schedule()
        runner.update_states(so)
        prepared = runner.prepare(so)
        done_at = device.launch()
        waited += device.wait(done_at)  # the sampled tokens come back
        scheduler.update_from_output(so, runner.record(prepared))
    wall = time.perf_counter() - start
    return LoopTimes(wall, wall - waited, device.idle_s, num_steps)


def run_async_loop(num_steps: int, warmup_steps: int, seed: int,
                   device_ms: float) -> LoopTimes:
    """Async scheduling: schedule and launch step N+1, then wait for step N and update."""
    scheduler, runner, source = make_scheduler(True), HostRunner(), RequestSource(seed)
    device = SimulatedDevice(device_ms)
    in_flight: tuple[SchedulerOutput, AsyncModelRunnerOutput, float] | None = None
    waited, start = 0.0, 0.0
    for step in range(warmup_steps + num_steps):
        if step == warmup_steps:
            device = SimulatedDevice(device_ms)
            waited, start = 0.0, time.perf_counter()
            if in_flight is not None:  # the warm-up's last step runs from now on
                in_flight = (in_flight[0], in_flight[1], device.launch())
        while scheduler.get_num_unfinished_requests() < MAX_NUM_SEQS:
            scheduler.add_request(source.next())
        so = scheduler.schedule()
        launched = runner.launch(so)
        done_at = device.launch() if step >= warmup_steps else 0.0
        if in_flight is not None:
            previous, output, previous_done_at = in_flight
            waited += device.wait(previous_done_at)
            scheduler.update_from_output(previous, output.result())
        in_flight = (so, launched, done_at)
    wall = time.perf_counter() - start
    return LoopTimes(wall, wall - waited, device.idle_s, num_steps)


def describe(name: str, values: list[float]) -> str:
    return (f"{name:<40} mean {statistics.fmean(values):7.3f} ms   "
            f"median {statistics.median(values):7.3f} ms   p90 {np.percentile(values, 90):7.3f} ms")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup-steps", type=int, default=300,
                        help="steps before measuring: the initial prefills, then steady state")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device-ms", type=float, default=None,
                        help="the simulated device's step time (default: the measured "
                             "synchronous host step)")
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
    overlap = measure_overlap(args, ms_per_step)
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
        **overlap,
    }))


def measure_overlap(args: argparse.Namespace, sync_host_ms: float) -> dict[str, float]:
    """Both loops against the simulated device; prints and returns their figures."""
    device_ms = sync_host_ms if args.device_ms is None else args.device_ms
    sync = run_sync_loop(args.steps, args.warmup_steps, args.seed, device_ms)
    overlapped = run_async_loop(args.steps, args.warmup_steps, args.seed, device_ms)
    print(f"\nagainst a simulated device step of {device_ms:.3f} ms:")
    print(f"{'':<26}{'host work':>12}{'wall':>12}{'device idle':>14}   (ms per step)")
    for name, loop in (("synchronous loop", sync), ("async scheduling", overlapped)):
        print(f"{name:<26}{loop.per_step_ms(loop.host_s):>12.3f}"
              f"{loop.per_step_ms(loop.wall_s):>12.3f}"
              f"{loop.per_step_ms(loop.device_idle_s):>14.3f}")
    ratio = sync.wall_s / overlapped.wall_s
    print(f"async scheduling: {ratio:.2f}x the synchronous loop's steps per second "
          f"(the bound is {(device_ms + sync.per_step_ms(sync.host_s)) / device_ms:.2f}x "
          f"when the host work fits in the device step)")
    return {
        "device_ms": round(device_ms, 4),
        "sync_host_ms": round(sync.per_step_ms(sync.host_s), 4),
        "async_host_ms": round(overlapped.per_step_ms(overlapped.host_s), 4),
        "sync_step_ms": round(sync.per_step_ms(sync.wall_s), 4),
        "async_step_ms": round(overlapped.per_step_ms(overlapped.wall_s), 4),
        "sync_device_idle_ms": round(sync.per_step_ms(sync.device_idle_s), 4),
        "async_device_idle_ms": round(overlapped.per_step_ms(overlapped.device_idle_s), 4),
        "overlap_ratio": round(ratio, 4),
    }


if __name__ == "__main__":
    main()
