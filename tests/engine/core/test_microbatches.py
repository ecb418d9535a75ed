"""The microbatch loop (seed 001's two-stage engine loop, engine_core._step_microbatches):
up to P microbatches in flight, a decoding request in at most one, a prompt's chunks
following each other through the stages, outputs equal to the synchronous loop's.

The executor is a pipeline simulated in time (engine/executor/simulated.py) over either
the real model runner (outputs compared with the synchronous engine, token for token) or
position-determined fake tokens (the loop alone)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvferry.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvferry.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvferry.engine.executor.base import Executor, InProcessExecutor
from kvferry.engine.executor.simulated import FakeTokens, SimulatedPipeline
from kvferry.engine.frontend.llm_engine import LLMEngine
from kvferry.engine.sampling_params import SamplingParams
from kvferry_testing.microbatches import ExecutorWrapper, Recorder

BLOCK_SIZE = 4
VOCAB = 256


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("LlamaForCausalLM", vocab_size=VOCAB)


def make_engine(model: Path, batches: int, *, num_blocks: int = 96,
                max_num_batched_tokens: int = 16, max_num_seqs: int = 8) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(model), max_model_len=96),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  max_concurrent_batches=batches),
        device="cpu",
    ))


def requests(num: int, seed: int = 0) -> list[tuple[str, list[int], SamplingParams]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, VOCAB, size=12).tolist()
    out = []
    for i in range(num):
        tail = rng.integers(3, VOCAB, size=int(rng.integers(2, 40))).tolist()
        prompt = shared + tail if i % 3 == 0 else tail  # some prefix hits
        kind = i % 4
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(4, 20)),
                                    ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=16,
                                    ignore_eos=True)
        elif kind == 2:
            params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
        else:
            params = SamplingParams(n=2, temperature=0.8, seed=i, max_tokens=10,
                                    repetition_penalty=1.1, ignore_eos=True)
        out.append((f"r{i}", prompt, params))
    return out


def generate(engine: LLMEngine, reqs: list[tuple[str, list[int], SamplingParams]]
             ) -> dict[str, list[tuple[list[int], Any]]]:
    for req_id, prompt, params in reqs:
        engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    final: dict[str, list[tuple[list[int], Any]]] = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                final[output.request_id] = [(list(c.token_ids), c.logprobs)
                                            for c in output.outputs]
    assert not engine.has_unfinished_requests()
    return final


@pytest.mark.parametrize("num_stages", [2, 3])
def test_microbatches_equal_the_synchronous_loop(checkpoint: Path, num_stages: int) -> None:
    """A mixed batch with chunked prefill, prefix hits and preemption (few blocks) through
    `num_stages` simulated stages: every completion equals the synchronous engine's."""
    reqs = requests(14)
    expected = generate(make_engine(checkpoint, 1, num_blocks=40), reqs)
    engine = make_engine(checkpoint, num_stages, num_blocks=40)
    core = engine.engine_core
    recorder = Recorder(InProcessExecutor(core.runner), num_stages, 0.004, core=core)
    core.executor = recorder
    got = generate(engine, reqs)
    assert got.keys() == expected.keys()
    for req_id, completions in expected.items():
        for (want_tokens, want_logprobs), (tokens, logprobs) in zip(
                completions, got[req_id], strict=True):
            assert tokens == want_tokens, req_id
            if want_logprobs is not None:
                for a, b in zip(want_logprobs, logprobs, strict=True):
                    assert a.keys() == b.keys()
                    for token, entry in a.items():
                        assert b[token].logprob == pytest.approx(entry.logprob, abs=1e-5)
    assert recorder.max_in_flight == num_stages
    assert engine.stats.scheduler.num_preemptions > 0
    assert engine.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks - 1


def test_the_loop_keeps_the_stages_busy_and_the_order(checkpoint: Path) -> None:
    """Fake tokens, two stages: two microbatches in flight, no decode in two at once, each
    request's tokens in position order, and a long prompt's chunks in consecutive
    microbatches while the one before is still in flight."""
    engine = make_engine(checkpoint, 2, num_blocks=200, max_num_batched_tokens=16)
    core = engine.engine_core
    recorder = Recorder(FakeTokens(VOCAB), 2, 0.003)
    pipeline = recorder.pipeline
    core.executor = recorder
    rng = np.random.default_rng(5)
    reqs = [(f"d{i}", rng.integers(3, VOCAB, size=5).tolist(),
             SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(6)]
    long_prompt = rng.integers(3, VOCAB, size=70).tolist()  # five chunks of at most 16
    reqs.append(("long", long_prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
    got = generate(engine, reqs)
    for req_id, prompt, params in reqs:
        positions = range(len(prompt), len(prompt) + params.max_tokens)
        assert got[req_id][0][0] == [(7 * p + 3) % VOCAB for p in positions], req_id
    assert recorder.max_in_flight == 2 and pipeline.max_in_flight == 2
    chunks = [i for i, step in enumerate(recorder.submitted) if "long" in step]
    assert len(chunks) >= 5 and recorder.overlapping_chunks >= 1
    # Each stage is busy for one stage time per microbatch it saw.
    assert pipeline.busy_seconds == [pytest.approx(0.003 * pipeline.num_submitted)] * 2


def test_a_failed_microbatch_ends_its_requests_and_the_loop_goes_on(checkpoint: Path) -> None:
    class FailsOnce(ExecutorWrapper):
        def __init__(self, inner: Executor) -> None:
            super().__init__(inner)
            self.failed = False

        def submit(self, scheduler_output: SchedulerOutput,
                   grammar_bitmask: Any = None) -> Future[ModelRunnerOutput]:
            future = self.inner.submit(scheduler_output, grammar_bitmask)
            if scheduler_output.total_num_scheduled_tokens and not self.failed:
                self.failed = True
                failed: Future[ModelRunnerOutput] = Future()
                failed.set_exception(RuntimeError("stage 1 lost"))
                return failed
            return future

    engine = make_engine(checkpoint, 2)
    core = engine.engine_core
    core.executor = SimulatedPipeline(FailsOnce(InProcessExecutor(core.runner)), 2, 0.002)
    engine.add_request("first", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(max_tokens=3, ignore_eos=True))
    first = [o for o in engine.step() if o.request_id == "first"]
    assert first and first[0].finished and first[0].outputs[0].finish_reason == "error"
    reqs = [("after", [9, 10, 11, 12], SamplingParams(max_tokens=5, ignore_eos=True))]
    assert len(generate(engine, reqs)["after"][0][0]) == 5
    assert engine.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks - 1


def test_async_scheduling_and_microbatches_are_exclusive() -> None:
    with pytest.raises(ValueError, match="set one of them"):
        SchedulerConfig(async_scheduling=True, max_concurrent_batches=2)
    with pytest.raises(ValueError, match="max_concurrent_batches must be >= 1"):
        SchedulerConfig(max_concurrent_batches=0)


def test_stage_busy_seconds_and_microbatches_reach_the_metrics(checkpoint: Path) -> None:
    from kvferry.engine.server.metrics import EngineMetrics
    from prometheus_client import generate_latest

    engine = make_engine(checkpoint, 2)
    core = engine.engine_core
    pipeline = SimulatedPipeline(FakeTokens(VOCAB), 2, 0.002)
    core.executor = pipeline
    metrics = EngineMetrics("m", BLOCK_SIZE, 96, True)
    for i in range(4):
        engine.add_request(f"s{i}", {"prompt_token_ids": [5 + i] * 6},
                           SamplingParams(max_tokens=4, ignore_eos=True))
    in_flight = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = core.make_stats()
        in_flight.append(stats.num_microbatches_in_flight)
        metrics.record_scheduler(stats)
    assert max(in_flight) == 1 and in_flight[-1] == 0  # one stays in flight after a step
    text = generate_latest(metrics.registry).decode()
    busy = 0.002 * pipeline.num_submitted
    for stage in (0, 1):
        sample = f'kvferry:pipeline_stage_busy_seconds_total{{model_name="m",stage="{stage}"}}'
        assert float(text.split(sample)[1].split()[0]) == pytest.approx(busy)
    assert 'kvferry:microbatches_in_flight{model_name="m"} 0.0' in text
