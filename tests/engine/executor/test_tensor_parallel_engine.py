"""Tensor parallelism through the whole engine on CPU (gloo, real worker processes):
`tensor_parallel_size=2` alone, and 2 pipeline stages of 2 tensor-parallel ranks each,
give the single-process engine's outputs token for token (greedy, seeded sampling,
logprobs, prompt logprobs, chunked prefill, prefix hits, preemption, structured outputs
whose bitmask only rank 0 of the last stage is sent). A killed rank, or a step that fails on
one rank by itself, ends the requests in flight with an error."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
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
from kvferry.engine.executor.pipeline import PipelineExecutor
from kvferry.engine.frontend.llm_engine import LLMEngine
from kvferry.engine.frontend.outputs import RequestOutput
from kvferry.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvferry_testing.compare_outputs import assert_same_outputs

BLOCK_SIZE = 4
Request = tuple[str, Any, SamplingParams]


def make_engine(model: Path, pp: int = 1, tp: int = 1, **model_fields: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(model), max_model_len=64, **model_fields),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=40),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=16),
        device="cpu",
        parallel=ParallelConfig(pipeline_parallel_size=pp, tensor_parallel_size=tp),
    ))


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    # 4 query heads over 2 kv heads (split 1 per rank), untied head, 3 layers (uneven
    # stages); a vocabulary of 250 is padded to 2 x 125 rows.
    return make_checkpoint(num_layers=3, vocab_size=250)


@pytest.fixture
def single(checkpoint: Path) -> Iterator[LLMEngine]:
    """The single-process engine, new for each test (its prefix cache starts empty, as the
    parallel engine's does)."""
    engine = make_engine(checkpoint)
    yield engine
    engine.shutdown()


def run(engine: LLMEngine, requests: list[Request]) -> dict[str, RequestOutput]:
    for req_id, prompt, params in requests:
        engine.add_request(req_id, prompt, params)
    last: dict[str, RequestOutput] = {}
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            last[output.request_id] = output
    else:
        raise AssertionError("requests left after 400 steps")
    assert engine.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks - 1
    return last


def greedy(max_tokens: int, **fields: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)


def mixed() -> list[Request]:
    prefix = list(range(10, 26))  # four full blocks, shared by two requests
    return [
        ("chunked", {"prompt_token_ids": list(range(50, 85))}, greedy(8)),
        ("prefix-a", {"prompt_token_ids": prefix + [90]}, greedy(6)),
        ("prefix-b", {"prompt_token_ids": prefix + [91, 92]}, greedy(6)),
        ("seeded", {"prompt_token_ids": [7, 8, 9]}, SamplingParams(
            temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)),
        ("unseeded", {"prompt_token_ids": [17, 18]}, SamplingParams(
            temperature=1.0, max_tokens=6, ignore_eos=True)),
        ("logprobs", {"prompt_token_ids": [70, 71, 72, 73]},
         greedy(5, logprobs=3, prompt_logprobs=2)),
        ("penalties", {"prompt_token_ids": [100, 101, 102]},
         greedy(8, repetition_penalty=1.3, frequency_penalty=0.5)),
        # Ids past the first rank's half of the vocabulary: looked up on rank 1.
        ("high-ids", {"prompt_token_ids": [240, 130, 249, 126]}, greedy(6)),
    ]


@pytest.mark.parametrize(("pp", "tp"), [(1, 2), (2, 2)])
def test_tensor_parallel_ranks_equal_the_single_process_engine(
        single: LLMEngine, checkpoint: Path, pp: int, tp: int) -> None:
    engine = make_engine(checkpoint, pp, tp)
    try:
        executor = engine.engine_core.executor
        assert isinstance(executor, PipelineExecutor) and engine.engine_core.runner is None
        assert len(executor.workers) == pp * tp
        assert [(w.stage.index, w.tp_rank) for w in executor.workers] == [
            (s, t) for s in range(pp) for t in range(tp)]
        # Each rank's KV cache holds its kv head of the two: half a stage's block.
        whole = single.engine_core.runner.kv_cache[0].numel() * 4  # float32, 3 layers
        layers = [s.num_layers for s in executor.stages for _ in range(tp)]
        assert [r.block_bytes for r in executor.ready] == [whole * n // 3 // 2 for n in layers]
        ours = run(engine, mixed())
    finally:
        engine.shutdown()
    theirs = run(single, mixed())
    # The unseeded request samples from each engine's own generator: compared by length.
    assert len(ours.pop("unseeded").outputs[0].token_ids) == 6
    theirs.pop("unseeded")
    assert_same_outputs(theirs, ours)
    assert ours["prefix-b"].num_cached_tokens == 16
    assert ours["logprobs"].outputs[0].logprobs is not None
    assert all(w.process.exitcode == 0 for w in executor.workers)


def test_preemption_under_tensor_parallelism_equals_the_single_process_engine(
        single: LLMEngine, checkpoint: Path) -> None:
    # Six requests growing to 40 tokens (10 blocks) each in 39 usable blocks.
    def requests() -> list[Request]:
        return [(f"r{i}", {"prompt_token_ids": list(range(20 + 9 * i, 40 + 9 * i))},
                 greedy(20) if i % 2 else SamplingParams(
                     temperature=1.0, seed=i, max_tokens=20, ignore_eos=True))
                for i in range(6)]

    engine = make_engine(checkpoint, 1, 2)
    try:
        ours = run(engine, requests())
        assert engine.stats.scheduler.num_preemptions > 0
    finally:
        engine.shutdown()
    assert_same_outputs(run(single, requests()), ours)


def test_a_grammar_bitmask_reaches_the_rank_that_samples(demo_checkpoint: Path) -> None:
    constrained = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=(
        StructuredOutputsParams(regex="(yes|no|maybe) [0-9]{1,3}")))

    def requests() -> list[Request]:
        return [("regex", "Answer:", constrained),
                ("free", "The river", SamplingParams(temperature=0.0, max_tokens=10))]

    outputs = []
    for tp in (1, 2):
        engine = make_engine(demo_checkpoint, 1, tp, dtype="float32")
        try:
            outputs.append(run(engine, requests()))
        finally:
            engine.shutdown()
    assert_same_outputs(outputs[0], outputs[1])
    text = outputs[1]["regex"].outputs[0].text
    assert text.split(" ")[0] in ("yes", "no", "maybe"), text


def test_heads_that_do_not_split_are_refused_before_any_worker_starts(
        make_checkpoint: Callable[..., Path]) -> None:
    path = make_checkpoint(num_heads=6, num_kv_heads=2, hidden_size=48)
    with pytest.raises(ValueError, match="6 attention heads do not split over tensor-parallel "
                                         "size 4"):
        make_engine(path, 1, 4)


def test_a_killed_rank_ends_the_requests_in_flight_with_an_error(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, 1, 2)
    executor = engine.engine_core.executor
    assert isinstance(executor, PipelineExecutor)
    try:
        for i in range(3):
            engine.add_request(f"r{i}", {"prompt_token_ids": [9 + i, 10 + i]}, greedy(50))
        engine.step()
        rank1 = executor.workers[1].process
        killed_at = time.monotonic()
        os.kill(rank1.pid, signal.SIGKILL)  # type: ignore[arg-type]
        finished: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            assert time.monotonic() - killed_at < 10.0, "requests still running"
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert sorted(finished) == ["r0", "r1", "r2"]
        assert {o.outputs[0].finish_reason for o in finished.values()} == {"error"}
        assert f"pipeline stage 0 tensor-parallel rank 1 (pid {rank1.pid}) was killed by " \
               "SIGKILL" in str(executor.failure)
    finally:
        engine.shutdown()
    # Rank 0, left waiting in a collective for the killed rank, was stopped too.
    assert all(w.process.exitcode is not None for w in executor.workers)


# Loaded by every Python process started with its folder first on PYTHONPATH (the workers):
# rank KVFERRY_TEST_FAIL_RANK's forward raises once, when the flag file exists.
FAIL_ONE_RANK = textwrap.dedent("""
    import os

    def _fail_once_on_one_rank():
        from kvferry.engine.executor import stage_runner

        rank, flag = int(os.environ["KVFERRY_TEST_FAIL_RANK"]), os.environ["KVFERRY_TEST_FAIL_FLAG"]
        run_model = stage_runner.StageRunner._run_model

        def run_or_fail(self, *args, **kwargs):
            if self.tp.rank == rank and os.path.exists(flag):
                os.remove(flag)
                raise RuntimeError("a failure of this rank alone")
            return run_model(self, *args, **kwargs)

        stage_runner.StageRunner._run_model = run_or_fail

    if os.environ.get("KVFERRY_TEST_FAIL_RANK"):
        _fail_once_on_one_rank()
""")


def test_a_step_failing_on_one_rank_alone_ends_the_requests_instead_of_hanging(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rank 0 waits in the forward's first all-reduce for a rank that skipped it: were the
    # failure only that step's, rank 0 would wait there (gloo: 30 minutes), and its next
    # collectives would pair with rank 1's of the next step.
    (tmp_path / "sitecustomize.py").write_text(FAIL_ONE_RANK)
    flag = tmp_path / "fail-now"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("KVFERRY_TEST_FAIL_RANK", "1")
    monkeypatch.setenv("KVFERRY_TEST_FAIL_FLAG", str(flag))
    engine = make_engine(checkpoint, 1, 2)
    executor = engine.engine_core.executor
    assert isinstance(executor, PipelineExecutor)
    # Without the fix the test would hang: after 60 s the workers are killed, which ends it.
    watchdog = threading.Timer(60.0, lambda: [os.kill(w.process.pid, signal.SIGKILL)
                                              for w in executor.workers
                                              if w.process.exitcode is None])
    watchdog.start()
    try:
        for i in range(3):
            engine.add_request(f"r{i}", {"prompt_token_ids": [9 + i, 10 + i]}, greedy(50))
        engine.step()
        flag.touch()
        failed_at = time.monotonic()
        finished: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert time.monotonic() - failed_at < 15.0, "the engine waited for the stuck rank"
        assert not flag.exists(), "rank 1 never ran the failing step"
        assert sorted(finished) == ["r0", "r1", "r2"]
        assert {o.outputs[0].finish_reason for o in finished.values()} == {"error"}
        failure = str(executor.failure)
        assert "tensor-parallel rank 1 of pipeline stage 0 failed microbatch" in failure
        assert "a failure of this rank alone" in failure and "cannot stay in step" in failure
    finally:
        watchdog.cancel()
        engine.shutdown()
    assert all(w.process.exitcode is not None for w in executor.workers)
