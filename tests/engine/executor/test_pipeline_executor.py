"""The pipeline executor with real worker processes (CPU, gloo): microbatches built by hand,
compared with the single-process `ModelRunner` running the same scheduler outputs.

The microbatches follow what the engine core's loop does with P in flight: disjoint
requests in each, a decode submitted only once its previous token came back. Stopping the
last stage (SIGSTOP) makes the overlap observable without timing anything: stage 0
reports that it computed two microbatches before the last stage started the first.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from kvferry.engine.config import CacheConfig, ParallelConfig
from kvferry.engine.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvferry.engine.executor.pipeline import PipelineExecutor, PipelineStageError
from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.runner.model_runner import ModelRunner
from kvferry.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 32
LIMITS = {"max_num_reqs": 8, "max_model_len": 32, "max_num_batched_tokens": 64}
# Seconds a future may take where the stages are idle otherwise (a loaded 2-core machine).
RESULT_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(num_layers=3)


def start_executor(path: Path, partition: list[int] | None = None, pp: int = 2,
                   tp: int = 1) -> PipelineExecutor:
    arch = ModelArchConfig.from_pretrained(path)
    executor = PipelineExecutor(
        path, arch, torch.float32, torch.device("cpu"),
        CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS),
        ParallelConfig(pipeline_parallel_size=pp, tensor_parallel_size=tp,
                       pp_layer_partition=partition), **LIMITS)
    executor.initialize_kv_cache(executor.num_blocks())
    return executor


@pytest.fixture(scope="module")
def executor(checkpoint: Path) -> Iterator[PipelineExecutor]:
    executor = start_executor(checkpoint)
    yield executor
    executor.shutdown()


def reference_runner(path: Path) -> ModelRunner:
    runner = ModelRunner(path, ModelArchConfig.from_pretrained(path), torch.float32,
                         torch.device("cpu"), CacheConfig(block_size=BLOCK_SIZE), **LIMITS)
    runner.initialize_kv_cache(NUM_BLOCKS)
    return runner


# ---------------------------------------------------------------------- microbatches
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def prefill(requests: dict[str, tuple[list[int], list[int]]],
            params: SamplingParams = GREEDY) -> SchedulerOutput:
    """New requests computing their whole prompts: id -> (prompt, block ids)."""
    new = [NewRequestData(req_id, list(prompt), len(prompt), params, list(blocks), 0)
           for req_id, (prompt, blocks) in requests.items()]
    scheduled = {req_id: len(prompt) for req_id, (prompt, _) in requests.items()}
    return SchedulerOutput(new, CachedRequestData(), scheduled, sum(scheduled.values()),
                           set(), set())


def decode(num_computed: dict[str, int], finished: tuple[str, ...] = ()) -> SchedulerOutput:
    """One token each for requests the runner holds, with `num_computed` cached."""
    cached = CachedRequestData(list(num_computed), {}, list(num_computed.values()))
    scheduled = dict.fromkeys(num_computed, 1)
    return SchedulerOutput([], cached, scheduled, len(scheduled), set(finished), set())


def tokens(output: ModelRunnerOutput) -> dict[str, int]:
    return dict(zip(output.req_ids, output.sampled_token_ids))


def result(future: Future[ModelRunnerOutput]) -> ModelRunnerOutput:
    return future.result(timeout=RESULT_TIMEOUT_S)


def wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


A = {"a1": ([5, 6, 7, 8, 9, 10], [1, 2]), "a2": ([11, 12, 13, 14, 15], [3, 4])}
B = {"b1": ([20, 21, 22, 23, 24, 25, 26], [5, 6])}


def microbatches() -> list[Callable[[], SchedulerOutput]]:
    """Two groups of requests alternating, as two microbatches in flight do: A's prefill,
    B's prefill, A's decode (after A's tokens came back), B's decode."""
    return [lambda: prefill(A), lambda: prefill(B),
            lambda: decode({"a1": 6, "a2": 5}), lambda: decode({"b1": 7})]


def test_stage_0_runs_the_next_microbatch_while_the_last_stage_has_not_started(
    executor: PipelineExecutor, checkpoint: Path,
) -> None:
    reference = reference_runner(checkpoint)
    expected = [tokens(reference.execute_model(make())) for make in microbatches()]
    last = executor.workers[-1].process.pid
    assert last is not None
    make_a, make_b, make_a2, make_b2 = microbatches()
    os.kill(last, signal.SIGSTOP)
    try:
        started = time.monotonic()
        futures = [executor.submit(make_a()), executor.submit(make_b())]
        assert time.monotonic() - started < 1.0  # neither submit waited for a stage
        ids = {executor.num_submitted - 2, executor.num_submitted - 1}
        # Stage 0 computes both microbatches while the last stage is stopped.
        wait_until(lambda: {t.step_id for t in executor.recent_timings
                            if t.stage_index == 0} >= ids, RESULT_TIMEOUT_S)
        assert not any(f.done() for f in futures) and executor.num_in_flight == 2
    finally:
        os.kill(last, signal.SIGCONT)
    outputs = [result(f) for f in futures]
    assert [tokens(o) for o in outputs] == expected[:2]
    timings = {(t.stage_index, t.step_id): t for t in executor.recent_timings}
    first_id = min(ids)
    assert timings[0, first_id + 1].finished < timings[1, first_id].started
    assert all(executor.stage_busy_seconds())
    # The decodes read the sampled tokens, which reached stage 0 with them.
    decodes = [executor.submit(make_a2()), executor.submit(make_b2())]
    assert [tokens(result(f)) for f in decodes] == expected[2:]
    executor.execute_model(decode({}, finished=("a1", "a2", "b1")))


def test_logprobs_and_seeded_sampling_equal_one_process(
    executor: PipelineExecutor, checkpoint: Path,
) -> None:
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=8, logprobs=2,
                            prompt_logprobs=1, ignore_eos=True)
    steps = [lambda: prefill(A, seeded), lambda: decode({"a1": 6, "a2": 5}),
             lambda: decode({"a1": 7, "a2": 6})]
    reference = reference_runner(checkpoint)
    for make in steps:
        want, got = reference.execute_model(make()), executor.execute_model(make())
        assert tokens(got) == tokens(want)
        assert got.logprobs is not None and want.logprobs is not None
        for got_row, want_row in zip(got.logprobs, want.logprobs, strict=True):
            assert [(t, r) for t, _, r in got_row] == [(t, r) for t, _, r in want_row]
            assert [p for _, p, _ in got_row] == pytest.approx([p for _, p, _ in want_row],
                                                               abs=1e-4)
        assert got.prompt_logprobs.keys() == want.prompt_logprobs.keys()
    executor.execute_model(decode({}, finished=("a1", "a2")))


def test_a_microbatch_that_fails_on_one_stage_fails_alone(
    executor: PipelineExecutor, checkpoint: Path,
) -> None:
    reference = reference_runner(checkpoint)
    # Token 10_000 is outside the vocabulary: stage 0's embedding fails on it; the last
    # stage never sees a token id and still reports the failure.
    bad = {"bad": ([3, 10_000, 4], [7])}
    steps: list[Callable[[], SchedulerOutput]] = [
        lambda: prefill(A), lambda: prefill({**bad, **B}), lambda: decode({"a1": 6, "a2": 5})]
    expected = []
    for make in steps:
        try:
            expected.append(tokens(reference.execute_model(make())))
        except IndexError:
            reference.recover_from_failed_step(["bad", "b1"])
            expected.append(None)
    got = []
    for make in steps:
        try:
            got.append(tokens(executor.execute_model(make())))
        except PipelineStageError as exc:
            assert exc.stage_index == 0
            assert str(exc).startswith("pipeline stage 0 failed microbatch")
            assert "IndexError" in str(exc)
            executor.recover_from_failed_step(["bad", "b1"])
            got.append(None)
    assert got == expected and got[1] is None and got[2]
    executor.execute_model(decode({}, finished=("a1", "a2")))


def test_a_microbatch_that_cannot_be_sent_fails_alone(executor: PipelineExecutor) -> None:
    broken = prefill(A)
    broken.blocked_stop_token_ids = {"a1": lambda: [2]}  # type: ignore[dict-item]
    future = executor.submit(broken)
    assert future.done()
    with pytest.raises(RuntimeError, match="cannot be sent to the pipeline stages"):
        future.result()
    assert tokens(executor.execute_model(prefill(A)))  # the stages never saw it
    executor.execute_model(decode({}, finished=("a1", "a2")))


def test_a_grammar_bitmask_reaches_the_last_stage(
    executor: PipelineExecutor, checkpoint: Path,
) -> None:
    from kvferry.engine.structured_output.manager import GrammarBitmask

    def bitmask_allowing(token_id: int, req_ids: list[str]) -> GrammarBitmask:
        rows = torch.zeros((len(req_ids), 256 // 32), dtype=torch.int32)
        rows[:, token_id // 32] = 1 << (token_id % 32)
        done: Future[torch.Tensor] = Future()
        done.set_result(rows)
        return GrammarBitmask(req_ids, done)

    output = executor.execute_model(prefill(A), bitmask_allowing(77, ["a2"]))
    assert tokens(output)["a2"] == 77
    failing: Future[torch.Tensor] = Future()
    failing.set_exception(RuntimeError("the grammar broke"))
    with pytest.raises(PipelineStageError, match="the grammar broke"):
        executor.execute_model(decode({"a1": 6, "a2": 5}), GrammarBitmask(["a1"], failing))
    executor.recover_from_failed_step(["a1", "a2"])
    assert tokens(executor.execute_model(prefill(B)))  # still in step


def test_a_failed_sample_fails_the_step_on_every_tensor_parallel_rank_alone(
    checkpoint: Path,
) -> None:
    # Rank 0 samples (it alone gets the bitmask): its failure reaches rank 1 with the
    # tokens' broadcast, both fail the step at the same point and stay in step.
    from kvferry.engine.structured_output.manager import GrammarBitmask

    executor = start_executor(checkpoint, pp=1, tp=2)
    try:
        assert tokens(executor.execute_model(prefill(A)))
        failing: Future[torch.Tensor] = Future()
        failing.set_exception(RuntimeError("the grammar broke"))
        with pytest.raises(PipelineStageError, match="the grammar broke"):
            executor.execute_model(decode({"a1": 6, "a2": 5}), GrammarBitmask(["a1"], failing))
        executor.recover_from_failed_step(["a1", "a2"])
        assert executor.failure is None
        reference = reference_runner(checkpoint)
        assert tokens(executor.execute_model(prefill(B))) == tokens(
            reference.execute_model(prefill(B)))
    finally:
        executor.shutdown()


def test_a_killed_stage_fails_pending_and_later_microbatches(checkpoint: Path) -> None:
    executor = start_executor(checkpoint, partition=[1, 2])
    try:
        assert tokens(executor.execute_model(prefill(A)))
        first, last = (w.process for w in executor.workers)
        os.kill(last.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        pending = [executor.submit(decode({"a1": 6, "a2": 5})), executor.submit(prefill(B))]
        time.sleep(0.5)
        killed_at = time.monotonic()
        os.kill(last.pid, signal.SIGKILL)  # type: ignore[arg-type]
        for future in pending:
            with pytest.raises(PipelineStageError,
                               match=rf"pipeline stage 1 \(pid {last.pid}\) was killed by "
                                     "SIGKILL"):
                future.result(timeout=10)
        assert time.monotonic() - killed_at < 5.0
        later = executor.submit(decode({"a1": 7}))
        assert later.done()  # fails at once: no stage waits for it
        with pytest.raises(PipelineStageError, match="pipeline stage 1"):
            later.result()
        assert executor.failure is not None and executor.failure.stage_index == 1
    finally:
        started = time.monotonic()
        executor.shutdown()
    assert time.monotonic() - started < 15.0
    assert all(w.process.exitcode is not None for w in executor.workers)
    assert first.exitcode is not None


def test_a_stage_that_cannot_load_its_layers_is_a_clear_error(
    checkpoint: Path, tmp_path: Path,
) -> None:
    import multiprocessing

    from safetensors.torch import load_file, save_file

    # Layer 2 (the last stage's) is missing from the checkpoint.
    (tmp_path / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    weights = load_file(str(checkpoint / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("model.layers.2.")},
              str(tmp_path / "model.safetensors"))
    before = set(multiprocessing.active_children())  # the module's executor's
    with pytest.raises(ValueError, match=r"pipeline stage 1 failed to start: ValueError: "
                                         r"checkpoint .* is missing 9 tensors the model "
                                         r"needs: model.layers.2."):
        start_executor(tmp_path)
    assert set(multiprocessing.active_children()) == before  # both stages reaped
