"""AsyncLLM against a real engine-core process: same tokens as `LLM`, streaming deltas,
aborts that free blocks, queue limits, and fast, loud failure when the core dies."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from kvferry import LLM, SamplingParams
from kvferry.engine.frontend.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from kvferry.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvferry.engine.core.messages import (
    AddRequest,
    CoreFailed,
    CoreStepOutputs,
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineLimits,
    FinishReason,
    SchedulerStats,
)
from kvferry.engine.frontend.outputs import RequestOutput
from kvferry.engine.frontend.stats import IterationStats
from kvferry.engine.frontend.tokenizer import Tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_MODEL_LEN = 128
NUM_BLOCKS = 64
# Seconds any single wait in these tests may take before the test fails instead of hanging.
TIMEOUT_S = 30.0
PROMPTS = ["w5 w6 w7", "w10 w11 w12 w13 w14", "w200", "w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"]


def make_config(
    checkpoint: Path, max_model_len: int = MAX_MODEL_LEN, num_blocks: int = NUM_BLOCKS,
    **scheduler: int,
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(checkpoint), max_model_len=max_model_len),
        cache=CacheConfig(num_gpu_blocks_override=num_blocks),
        scheduler=SchedulerConfig(**scheduler),
        device="cpu",
    )


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> Path:
    return make_checkpoint("LlamaForCausalLM")


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLM:
    return LLM(
        model=str(checkpoint), max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=NUM_BLOCKS,
        device="cpu",
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(checkpoint: Path) -> AsyncIterator[AsyncLLM]:
    async_llm = await asyncio.wait_for(AsyncLLM.create(make_config(checkpoint)), TIMEOUT_S)
    try:
        yield async_llm
    finally:
        await async_llm.shutdown()


@pytest_asyncio.fixture(loop_scope="module")
async def own_engine(checkpoint: Path) -> AsyncIterator[AsyncLLM]:
    """An engine for one test (tests that kill it or change its limits): one request runs at
    a time, one may wait, and a request may run for up to 1,000 steps."""
    config = make_config(checkpoint, max_model_len=1024, num_blocks=80, max_num_seqs=1)
    async_llm = await asyncio.wait_for(
        AsyncLLM.create(config, max_num_waiting=1), TIMEOUT_S
    )
    try:
        yield async_llm
    finally:
        await async_llm.shutdown()


async def collect(
    engine: AsyncLLM, request_id: str, prompt: str, params: SamplingParams
) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        return [out async for out in engine.generate(request_id, prompt, params)]

    return await asyncio.wait_for(run(), TIMEOUT_S)


def joined(deltas: list[RequestOutput], index: int = 0) -> tuple[list[int], str]:
    """Token ids and text of completion `index`, from a request's DELTA outputs."""
    token_ids: list[int] = []
    text = ""
    for out in deltas:
        for completion in out.outputs:
            if completion.index == index:
                token_ids.extend(completion.token_ids)
                text += completion.text
    return token_ids, text


def final_completion(deltas: list[RequestOutput], index: int = 0):  # noqa: ANN201
    return next(c for out in reversed(deltas) for c in out.outputs if c.index == index)


async def wait_for_stats(
    engine: AsyncLLM, check: Callable[[SchedulerStats], bool], timeout_s: float = 5.0
) -> SchedulerStats:
    deadline = time.monotonic() + timeout_s
    while not check(engine.scheduler_stats):
        assert time.monotonic() < deadline, f"stats never matched: {engine.scheduler_stats}"
        await asyncio.sleep(0.01)
    return engine.scheduler_stats


# ---------------------------------------------------------------------- same outputs as LLM
async def test_greedy_tokens_equal_llm_generate(engine: AsyncLLM, llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = llm.generate(PROMPTS, params)
    results = await asyncio.gather(*(
        collect(engine, f"greedy-{i}", prompt, params) for i, prompt in enumerate(PROMPTS)
    ))
    for deltas, want in zip(results, expected):
        token_ids, text = joined(deltas)
        assert token_ids == want.outputs[0].token_ids
        assert text == want.outputs[0].text
        assert [out.finished for out in deltas] == [False] * (len(deltas) - 1) + [True]
        assert final_completion(deltas).finish_reason == "length"
        assert deltas[0].prompt_token_ids == want.prompt_token_ids


async def test_a_consumer_that_falls_behind_gets_merged_deltas(
    engine: AsyncLLM, llm: LLM
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    want = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    stream = engine.generate("behind", PROMPTS[0], params)
    first = await asyncio.wait_for(anext(stream), TIMEOUT_S)
    assert len(first.outputs[0].token_ids) == 1
    await wait_for_stats(engine, lambda s: s.num_running_reqs == 0)  # all 12 steps are done
    rest = await asyncio.wait_for(_drain(stream), TIMEOUT_S)
    assert len(rest) == 1 and rest[0].finished
    merged = rest[0].outputs[0]
    assert first.outputs[0].token_ids + merged.token_ids == want.token_ids
    assert first.outputs[0].text + merged.text == want.text
    assert len(merged.logprobs) == 11
    assert merged.finish_reason == "length"
    assert merged.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)


async def test_seeded_n2_equals_llm_generate(engine: AsyncLLM, llm: LLM) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    want = llm.generate([PROMPTS[1]], params)[0]
    deltas = await collect(engine, "n2", PROMPTS[1], params)
    for index in (0, 1):
        assert joined(deltas, index)[0] == want.outputs[index].token_ids
        assert final_completion(deltas, index).finish_reason == "length"
    assert joined(deltas, 0)[0] != joined(deltas, 1)[0]
    assert engine.num_unfinished_requests() == 0


async def test_stop_string_ends_the_request(engine: AsyncLLM, llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = llm.generate([PROMPTS[0]], greedy)[0].outputs[0].token_ids
    stop = f"w{tokens[2]}"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop])
    want = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    deltas = await collect(engine, "stop", PROMPTS[0], params)
    token_ids, text = joined(deltas)
    done = final_completion(deltas)
    assert (token_ids, text) == (want.token_ids, want.text)
    assert (done.finish_reason, done.stop_reason) == ("stop", stop)
    assert stop not in text
    # The core was told to free the sequence the stop string ended.
    await wait_for_stats(engine, lambda s: s.num_running_reqs == 0)


async def test_logprobs_equal_llm_generate(engine: AsyncLLM, llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    want = llm.generate([PROMPTS[2]], params)[0].outputs[0]
    deltas = await collect(engine, "logprobs", PROMPTS[2], params)
    logprobs = [p for out in deltas for p in out.outputs[0].logprobs]
    assert len(logprobs) == 4
    for got, expected in zip(logprobs, want.logprobs):
        assert got.keys() == expected.keys()
        for token_id, entry in got.items():
            assert entry.logprob == pytest.approx(expected[token_id].logprob, abs=1e-5)
            assert entry.rank == expected[token_id].rank
            assert entry.decoded_token == expected[token_id].decoded_token
    assert final_completion(deltas).cumulative_logprob == pytest.approx(
        want.cumulative_logprob, abs=1e-4
    )


# ---------------------------------------------------------------------- many at once
async def test_200_concurrent_requests_each_finish_once(engine: AsyncLLM) -> None:
    async def run(i: int) -> tuple[int, list[RequestOutput]]:
        params = SamplingParams(temperature=0.0, max_tokens=1 + i % 4, ignore_eos=True)
        return i, await collect(engine, f"many-{i}", PROMPTS[i % len(PROMPTS)], params)

    results = await asyncio.gather(*(run(i) for i in range(200)))
    for i, deltas in results:
        assert {out.request_id for out in deltas} == {f"many-{i}"}
        assert sum(out.finished for out in deltas) == 1 and deltas[-1].finished
        assert len(joined(deltas)[0]) == 1 + i % 4
    assert engine.num_unfinished_requests() == 0
    await wait_for_stats(engine, lambda s: s.num_running_reqs == 0 and s.num_waiting_reqs == 0)


# ---------------------------------------------------------------------- aborts
async def _start_long_request(
    engine: AsyncLLM, request_id: str, max_tokens: int = 100
):  # noqa: ANN202
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    stream = engine.generate(request_id, PROMPTS[3], params)
    first = await asyncio.wait_for(anext(stream), TIMEOUT_S)
    assert not first.finished
    return stream


async def test_closing_the_stream_frees_the_blocks_at_once(engine: AsyncLLM) -> None:
    idle = await wait_for_stats(engine, lambda s: s.num_running_reqs == 0)
    stream = await _start_long_request(engine, "closed")
    busy = await wait_for_stats(engine, lambda s: s.num_running_reqs == 1)
    assert busy.kv_cache_usage > idle.kv_cache_usage
    await stream.aclose()
    assert engine.num_unfinished_requests() == 0
    stats = await wait_for_stats(engine, lambda s: s.num_running_reqs == 0)
    assert stats.kv_cache_usage == idle.kv_cache_usage


async def test_cancelling_the_consumer_aborts(engine: AsyncLLM) -> None:
    idle = await wait_for_stats(engine, lambda s: s.num_running_reqs == 0)
    started = asyncio.Event()

    async def consume() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        async for _ in engine.generate("cancelled", PROMPTS[3], params):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), TIMEOUT_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.num_unfinished_requests() == 0
    stats = await wait_for_stats(engine, lambda s: s.num_running_reqs == 0)
    assert stats.kv_cache_usage == idle.kv_cache_usage


async def test_abort_ends_the_stream_with_finish_reason_abort(engine: AsyncLLM) -> None:
    stream = await _start_long_request(engine, "aborted")
    await engine.abort("aborted")
    rest = await asyncio.wait_for(_drain(stream), TIMEOUT_S)
    assert rest[-1].finished
    assert final_completion(rest).finish_reason == "abort"
    await wait_for_stats(engine, lambda s: s.num_running_reqs == 0)


async def _drain(stream) -> list[RequestOutput]:  # noqa: ANN001
    return [out async for out in stream]


async def test_wait_until_idle_waits_for_requests_in_flight(engine: AsyncLLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    task = asyncio.create_task(collect(engine, "drained", PROMPTS[0], params))
    while engine.num_unfinished_requests() == 0:
        await asyncio.sleep(0)
    assert await engine.wait_until_idle(TIMEOUT_S)
    assert task.done() and task.result()[-1].finished


# ---------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "the prompt is empty"),
        ({"prompt_token_ids": [5, 256]}, SamplingParams(), "outside the vocabulary [0, 256)"),
        ({"prompt_token_ids": [5] * (MAX_MODEL_LEN + 1)}, SamplingParams(),
         f"more than the maximum model length of {MAX_MODEL_LEN}"),
        ("w5", SamplingParams(stop_token_ids=[300]), "stop_token_ids[0] = 300"),
    ],
)
async def test_invalid_requests_never_reach_the_core(
    engine: AsyncLLM, prompt, params: SamplingParams, message: str  # noqa: ANN001
) -> None:
    sent_before = engine._num_sequences_sent
    with pytest.raises(ValueError) as excinfo:
        await anext(engine.generate("invalid", prompt, params))
    assert message in str(excinfo.value)
    assert engine._num_sequences_sent == sent_before
    assert engine.num_unfinished_requests() == 0
    # And the engine goes on serving.
    deltas = await collect(engine, "after-invalid", "w5", SamplingParams(max_tokens=2))
    assert deltas[-1].finished


async def test_duplicate_request_id_is_refused(engine: AsyncLLM) -> None:
    stream = await _start_long_request(engine, "dup")
    with pytest.raises(ValueError, match="already in use"):
        await anext(engine.generate("dup", "w5", SamplingParams()))
    await stream.aclose()
    await wait_for_stats(engine, lambda s: s.num_running_reqs == 0)


# ---------------------------------------------------------------------- stats
async def test_stats_listener_sees_tokens_latencies_and_queue_times(engine: AsyncLLM) -> None:
    seen: list[tuple[SchedulerStats, IterationStats]] = []
    engine.add_stats_listener(lambda sched, it: seen.append((sched, it)))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    await collect(engine, "stats", PROMPTS[1], params)
    iterations = [it for _, it in seen]
    assert sum(it.num_prompt_tokens for it in iterations) == 5
    assert sum(it.num_generation_tokens for it in iterations) == 3
    assert len([t for it in iterations for t in it.time_to_first_tokens]) == 1
    assert len([t for it in iterations for t in it.inter_token_latencies]) == 2
    assert [r for it in iterations for r in it.finish_reasons] == ["length"]
    queue_times = [t for it in iterations for t in it.queue_times]
    assert len(queue_times) == 1 and 0.0 <= queue_times[0] < TIMEOUT_S


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


async def test_idle_core_does_not_spin(engine: AsyncLLM) -> None:
    await wait_for_stats(engine, lambda s: s.num_running_reqs == 0 and s.num_waiting_reqs == 0)
    pid = engine.core_pid
    assert pid is not None
    before = _cpu_seconds(pid)
    await asyncio.sleep(1.5)
    assert _cpu_seconds(pid) - before <= 0.05


# ---------------------------------------------------------------------- queue limit
async def test_queue_full_when_max_num_waiting_is_reached(own_engine: AsyncLLM) -> None:
    running = await _start_long_request(own_engine, "running", max_tokens=1000)
    waiting = own_engine.generate("waiting", "w5", SamplingParams(max_tokens=2))
    refused = own_engine.generate("refused", "w5", SamplingParams(max_tokens=2))
    # Both first steps run in one loop pass: "waiting" is still in the socket, not yet in
    # the core's stats, when "refused" is checked.
    waiting_first = asyncio.ensure_future(anext(waiting))
    refused_first = asyncio.ensure_future(anext(refused))
    with pytest.raises(QueueFullError, match="at or past the limit of 1"):
        await refused_first
    # Now the core reports it waiting (max_num_seqs=1).
    await wait_for_stats(own_engine, lambda s: s.num_waiting_reqs == 1)
    with pytest.raises(QueueFullError):
        await anext(own_engine.generate("refused-too", "w5", SamplingParams(max_tokens=2)))
    await running.aclose()
    first = await asyncio.wait_for(waiting_first, TIMEOUT_S)
    rest = [first, *await asyncio.wait_for(_drain(waiting), TIMEOUT_S)]
    assert rest[-1].finished and final_completion(rest).finish_reason == "length"


# ---------------------------------------------------------------------- death
async def test_killed_core_fails_requests_fast(own_engine: AsyncLLM) -> None:
    errors: list[EngineDeadError] = []
    own_engine.add_dead_listener(errors.append)
    stream = await _start_long_request(own_engine, "doomed", max_tokens=1000)
    assert own_engine.is_ready and not own_engine.is_dead
    killed_at = time.monotonic()
    os.kill(own_engine.core_pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
        await asyncio.wait_for(_drain(stream), 2.0)
    assert time.monotonic() - killed_at < 2.0
    assert own_engine.is_dead and not own_engine.is_ready
    assert len(errors) == 1
    assert own_engine.num_unfinished_requests() == 0
    with pytest.raises(EngineDeadError):
        await anext(own_engine.generate("late", "w5", SamplingParams()))


async def test_loading_failure_raises_engine_dead_error_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    config = EngineConfig(model=ModelConfig(model=str(tmp_path)), device="cpu")
    with pytest.raises(EngineDeadError, match="failed to load the model") as excinfo:
        await asyncio.wait_for(AsyncLLM.create(config), TIMEOUT_S)
    assert "ValueError: config.json lacks the required field" in str(excinfo.value)


async def test_missing_model_dir_raises_engine_dead_error(tmp_path: Path) -> None:
    config = EngineConfig(model=ModelConfig(model=str(tmp_path / "missing")), device="cpu")
    with pytest.raises(EngineDeadError, match="does not exist"):
        await asyncio.wait_for(AsyncLLM.create(config), TIMEOUT_S)


async def test_shutdown_stops_the_core_and_refuses_requests(checkpoint: Path) -> None:
    async_llm = await asyncio.wait_for(AsyncLLM.create(make_config(checkpoint)), TIMEOUT_S)
    pid = async_llm.core_pid
    await async_llm.shutdown()
    assert not async_llm.is_ready and not async_llm.is_dead
    assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid)
    with pytest.raises(EngineDeadError, match="shut down"):
        await anext(async_llm.generate("after", "w5", SamplingParams()))
    await async_llm.shutdown()  # idempotent


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# ---------------------------------------------------------------------- a stand-in core
class FakeClient:
    """The core's end of AsyncLLM's client, driven by the test."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.outputs: asyncio.Queue[object] = asyncio.Queue()
        self.on_exit = None
        self.pid = None

    def send(self, message: object) -> None:
        self.sent.append(message)

    async def recv(self) -> object:
        return await self.outputs.get()

    def watch_exit(self, on_exit) -> None:  # noqa: ANN001
        self.on_exit = on_exit

    def describe_exit(self) -> str:
        return "exited with code 3"

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        return None

    def step(self, *outputs: EngineCoreOutput, num_received: int = 0) -> None:
        self.outputs.put_nowait(CoreStepOutputs(
            EngineCoreOutputs(list(outputs), SchedulerStats()), num_received
        ))


@pytest_asyncio.fixture(loop_scope="module")
async def fake(checkpoint: Path) -> AsyncIterator[tuple[AsyncLLM, FakeClient]]:
    client = FakeClient()
    info = EngineCoreInfo(
        model_dir=str(checkpoint), architecture="LlamaForCausalLM",
        limits=EngineLimits(MAX_MODEL_LEN, 256, 2048, True), eos_token_ids=[2],
        block_size=16, num_blocks=NUM_BLOCKS,
    )
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    async_llm = AsyncLLM(make_config(checkpoint), client, info, tokenizer)  # type: ignore[arg-type]
    try:
        yield async_llm, client
    finally:
        await async_llm.shutdown()


async def test_a_failed_sequence_ends_with_finish_reason_error(fake) -> None:  # noqa: ANN001
    engine, client = fake
    params = SamplingParams(max_tokens=4)
    bad, good = engine.generate("bad", "w5", params), engine.generate("good", "w6", params)
    bad_first, good_first = asyncio.ensure_future(anext(bad)), asyncio.ensure_future(anext(good))
    await asyncio.sleep(0)
    assert [m.request.req_id for m in client.sent if isinstance(m, AddRequest)] == [
        "bad", "good"
    ]
    client.step(EngineCoreOutput("bad", [], finish_reason=FinishReason.ERROR),
                EngineCoreOutput("good", [9]))
    failed = await asyncio.wait_for(bad_first, TIMEOUT_S)
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert (await asyncio.wait_for(good_first, TIMEOUT_S)).outputs[0].token_ids == [9]
    client.step(EngineCoreOutput("good", [10], finish_reason=FinishReason.LENGTH))
    rest = await asyncio.wait_for(_drain(good), TIMEOUT_S)
    assert [c.token_ids for out in rest for c in out.outputs] == [[10]]


async def test_a_failing_stats_listener_does_not_stop_outputs(fake) -> None:  # noqa: ANN001
    engine, client = fake

    def broken(_sched: SchedulerStats, _it: IterationStats) -> None:
        raise RuntimeError("listener bug")

    engine.add_stats_listener(broken)
    stream = engine.generate("listened", "w5", SamplingParams(max_tokens=1))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    client.step(EngineCoreOutput("listened", [9], finish_reason=FinishReason.LENGTH))
    assert (await asyncio.wait_for(first, TIMEOUT_S)).finished


async def test_core_failure_message_fails_requests_with_its_text(fake) -> None:  # noqa: ANN001
    engine, client = fake
    stream = engine.generate("in-flight", "w5", SamplingParams(max_tokens=4))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    client.outputs.put_nowait(CoreFailed("RuntimeError: CUDA error: out of memory"))
    with pytest.raises(EngineDeadError, match="CUDA error: out of memory"):
        await asyncio.wait_for(first, TIMEOUT_S)
    assert engine.is_dead and engine.dead_error is not None
