"""`pipeline_parallel_size=2` through the whole engine on CPU (gloo, real worker processes):
outputs equal the single-process engine's on the same 3-layer random checkpoint (so the
split is uneven), token for token.

Each scenario runs the same requests through both engines: a mixed batch with chunked
prefill, prefix hits, seeded sampling, n > 1, logprobs, prompt logprobs, penalties and stop
conditions; preemption; aborts mid-run; prompts given as embeddings; structured outputs
(the grammar bitmask reaches the last stage). Both engines end idle. Another test kills a stage
and checks that the requests in flight end with an error within seconds.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvferry.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvferry.engine.executor.base import InProcessExecutor
from kvferry.engine.executor.pipeline import PipelineExecutor
from kvferry.engine.frontend.llm_engine import LLMEngine
from kvferry.engine.frontend.outputs import RequestOutput
from kvferry.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvferry_testing.compare_outputs import assert_same_outputs

BLOCK_SIZE = 4
EOS = 2
Request = tuple[str, Any, SamplingParams]


def make_engine(model: Path, pipeline_parallel_size: int, *, num_blocks: int = 40,
                partition: list[int] | None = None, **model_fields: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(model), max_model_len=64, **model_fields),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=16),
        device="cpu",
        parallel=ParallelConfig(pipeline_parallel_size=pipeline_parallel_size,
                                pp_layer_partition=partition),
    ))


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(num_layers=3)


@pytest.fixture(scope="module")
def engines(checkpoint: Path) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    """The single-process engine and the two-stage one, reused across scenarios (each
    ends idle)."""
    single = make_engine(checkpoint, 1, enable_prompt_embeds=True)
    pipeline = make_engine(checkpoint, 2, enable_prompt_embeds=True)
    assert isinstance(pipeline.engine_core.executor, PipelineExecutor)
    assert pipeline.engine_core.runner is None  # the stages' processes hold the model
    # As many microbatches in flight as there are stages.
    assert pipeline.config.scheduler.max_concurrent_batches == 2
    assert isinstance(single.engine_core.executor, InProcessExecutor)
    yield single, pipeline
    pipeline.shutdown()
    single.shutdown()


def run(engine: LLMEngine, requests: list[Request],
        abort_after: dict[str, int] | None = None,
        in_flight: list[int] | None = None) -> dict[str, RequestOutput]:
    """Adds the requests and steps to the end; `abort_after[id] = k` aborts a request once
    its first completion has k tokens; `in_flight` gets the microbatches still in flight
    after each step. Returns each request's last output."""
    for req_id, prompt, params in requests:
        engine.add_request(req_id, prompt, params)
    abort_after = dict(abort_after or {})
    last: dict[str, RequestOutput] = {}
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        outputs = engine.step()
        if in_flight is not None:
            in_flight.append(engine.stats.scheduler.num_microbatches_in_flight)
        for output in outputs:
            last[output.request_id] = output
            if len(output.outputs[0].token_ids) >= abort_after.get(output.request_id, 1 << 30):
                del abort_after[output.request_id]
                for aborted in engine.abort_request(output.request_id):
                    last[aborted.request_id] = aborted
    else:
        raise AssertionError("requests left after 400 steps")
    return last


def assert_idle(engine: LLMEngine) -> None:
    assert engine.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks - 1
    assert engine.step() == []  # delivers the last finished ids to the stages
    assert not engine.has_unfinished_requests()


def both_ways(engines: tuple[LLMEngine, LLMEngine], requests: Callable[[], list[Request]],
              abort_after: dict[str, int] | None = None,
              in_flight: list[int] | None = None) -> dict[str, RequestOutput]:
    """Runs the requests on both engines (`in_flight`: the pipeline's microbatches in
    flight after each step); checks they agree and both end idle."""
    outputs = []
    for engine in engines:
        pipelined = engine.engine_core.runner is None
        outputs.append(run(engine, requests(), abort_after, in_flight if pipelined else None))
        assert_idle(engine)
    assert_same_outputs(outputs[0], outputs[1])
    return outputs[1]


def greedy(max_tokens: int, **fields: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **fields)


# ---------------------------------------------------------------------- equal outputs
def test_a_mixed_batch_equals_the_single_process_engine(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    prefix = list(range(10, 26))  # four full blocks, shared by two requests
    stop_prompt = [40, 41, 42, 43, 44]
    # On both engines, so that both prefix caches hold its blocks.
    ref = both_ways(engines, lambda: [("ref", {"prompt_token_ids": stop_prompt},
                                       greedy(12, ignore_eos=True))])["ref"].outputs[0].token_ids

    def requests() -> list[Request]:
        return [
            # A prompt longer than the 16-token budget: chunked prefill.
            ("chunked", {"prompt_token_ids": list(range(50, 85))}, greedy(8, ignore_eos=True)),
            ("prefix-a", {"prompt_token_ids": prefix + [90]}, greedy(6, ignore_eos=True)),
            ("prefix-b", {"prompt_token_ids": prefix + [91, 92]}, greedy(6, ignore_eos=True)),
            ("seeded", {"prompt_token_ids": [7, 8, 9]}, SamplingParams(
                temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)),
            ("n3", {"prompt_token_ids": [11, 12]}, SamplingParams(
                n=3, temperature=1.0, seed=11, max_tokens=7, ignore_eos=True)),
            # Stops at the token it samples third, or at the fifth (the front end finds
            # the string and aborts the request in the core).
            ("stop-token", {"prompt_token_ids": stop_prompt},
             greedy(12, stop_token_ids=[ref[2]], ignore_eos=True)),
            ("stop-string", {"prompt_token_ids": stop_prompt},
             greedy(12, stop=[f"w{ref[4]}"], ignore_eos=True)),
            ("logprobs", {"prompt_token_ids": [70, 71, 72, 73]},
             greedy(5, logprobs=3, prompt_logprobs=2, ignore_eos=True)),
            ("eos", {"prompt_token_ids": [80, 81]},
             greedy(10, min_tokens=3, logit_bias={EOS: 30.0})),
            ("penalties", {"prompt_token_ids": [100, 101, 102]}, greedy(
                8, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                ignore_eos=True)),
        ]

    in_flight: list[int] = []
    outputs = both_ways(engines, requests, in_flight=in_flight)
    # The step returned with the next microbatch still in the stages.
    assert max(in_flight) == 1
    assert len(outputs["chunked"].outputs[0].token_ids) == 8
    assert outputs["prefix-b"].num_cached_tokens == len(prefix)
    assert outputs["eos"].outputs[0].token_ids[3:] == [EOS]
    assert len({tuple(c.token_ids) for c in outputs["n3"].outputs}) == 3
    assert outputs["logprobs"].outputs[0].logprobs is not None
    assert outputs["stop-token"].outputs[0].finish_reason == "stop"
    assert len(outputs["stop-token"].outputs[0].token_ids) <= 3
    assert outputs["stop-string"].outputs[0].stop_reason == f"w{ref[4]}"


def test_preemption_equals_the_single_process_engine(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    _single, pipeline = engines
    preemptions_before = pipeline.stats.scheduler.num_preemptions

    # Six requests growing to 40 tokens (10 blocks) each in 39 usable blocks.
    def requests() -> list[Request]:
        return [(f"r{i}", {"prompt_token_ids": list(range(20 + 9 * i, 40 + 9 * i))},
                 greedy(20, ignore_eos=True) if i % 2 else SamplingParams(
                     temperature=1.0, seed=i, max_tokens=20, ignore_eos=True))
                for i in range(6)]

    both_ways(engines, requests)
    assert pipeline.stats.scheduler.num_preemptions > preemptions_before


def test_aborts_mid_run_equal_the_single_process_engine(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    def requests() -> list[Request]:
        return [(f"r{i}", {"prompt_token_ids": [30 + i, 31 + i, 32 + i]},
                 greedy(10, ignore_eos=True)) for i in range(5)]

    outputs = both_ways(engines, requests, abort_after={"r1": 1, "r3": 4})
    assert [len(outputs[r].outputs[0].token_ids) for r in ("r1", "r3")] == [1, 4]
    assert outputs["r1"].outputs[0].finish_reason == "abort"


def test_prompt_embeddings_equal_the_single_process_engine(
    engines: tuple[LLMEngine, LLMEngine], checkpoint: Path,
) -> None:
    import torch
    from safetensors.torch import load_file

    # Stage 0 reads the embeddings (a long prompt: chunked); the last stage, which has no
    # embedding table of its own, samples.
    table = load_file(str(checkpoint / "model.safetensors"))["model.embed_tokens.weight"]
    gen = torch.Generator().manual_seed(4)
    embeds = [torch.randn(n, table.shape[1], generator=gen) * 0.5 for n in (5, 23)]

    def requests() -> list[Request]:
        return [(f"e{i}", {"prompt_embeds": e}, greedy(6, ignore_eos=True))
                for i, e in enumerate(embeds)] + [
            ("ids", {"prompt_embeds": table[[7, 8, 9]]}, greedy(6, ignore_eos=True))]

    outputs = both_ways(engines, requests)
    tokens = run(engines[1], [("plain", {"prompt_token_ids": [7, 8, 9]},
                               greedy(6, ignore_eos=True))])
    assert outputs["ids"].outputs[0].token_ids == tokens["plain"].outputs[0].token_ids


def test_structured_outputs_equal_the_single_process_engine(
    demo_checkpoint: Path,
) -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "n"], "additionalProperties": False}
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=(
        StructuredOutputsParams(json=schema)))

    def requests() -> list[Request]:
        return [("json-a", "Hello there", constrained), ("json-b", "x", constrained),
                ("regex", "Answer:", SamplingParams(
                    temperature=1.0, seed=5, max_tokens=40,
                    structured_outputs=StructuredOutputsParams(
                        regex="(yes|no|maybe) [0-9]{1,3}"))),
                ("free", "The river", SamplingParams(temperature=0.0, max_tokens=12))]

    engines = (make_engine(demo_checkpoint, 1, dtype="float32"),
               make_engine(demo_checkpoint, 2, dtype="float32"))
    try:
        outputs = both_ways(engines, requests)
    finally:
        for engine in engines:
            engine.shutdown()
    for req_id in ("json-a", "json-b"):
        assert set(json.loads(outputs[req_id].outputs[0].text)) == {"name", "n"}


# ---------------------------------------------------------------------- failure
def test_a_killed_stage_ends_the_requests_in_flight_with_an_error(
    engines: tuple[LLMEngine, LLMEngine], checkpoint: Path,
) -> None:
    from kvferry import LLM

    llm = LLM(str(checkpoint), max_model_len=64, block_size=BLOCK_SIZE, device="cpu",
              num_gpu_blocks_override=40, pipeline_parallel_size=2, pp_layer_partition=[1, 2])
    engine = llm.llm_engine
    executor = engine.engine_core.executor
    try:
        assert executor is not None
        assert [(s.start_layer, s.end_layer) for s in executor.stages] == [(0, 1), (1, 3)]
        prompts = [[5, 6, 7], [8, 9]]
        reference = run(engines[0], [(f"ref{i}", {"prompt_token_ids": p},
                                      greedy(4, ignore_eos=True))
                                     for i, p in enumerate(prompts)])
        expected = [reference[f"ref{i}"].outputs[0].token_ids for i in range(len(prompts))]
        got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           greedy(4, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == expected
        for i in range(3):
            engine.add_request(f"r{i}", {"prompt_token_ids": [9 + i, 10 + i]},
                               greedy(50, ignore_eos=True))
        engine.step()
        stage0 = executor.workers[0].process
        killed_at = time.monotonic()
        os.kill(stage0.pid, signal.SIGKILL)  # type: ignore[arg-type]
        finished: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            assert time.monotonic() - killed_at < 10.0, "requests still running"
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert time.monotonic() - killed_at < 5.0
        assert sorted(finished) == ["r0", "r1", "r2"]
        assert {o.outputs[0].finish_reason for o in finished.values()} == {"error"}
        assert executor.failure is not None
        assert f"pipeline stage 0 (pid {stage0.pid}) was killed by SIGKILL" in str(
            executor.failure)
        # A request added afterwards fails at once too.
        later = run(engine, [("later", {"prompt_token_ids": [3, 4]}, greedy(3))])
        assert later["later"].outputs[0].finish_reason == "error"
    finally:
        llm.shutdown()
    assert all(w.process.exitcode is not None for w in executor.workers)
