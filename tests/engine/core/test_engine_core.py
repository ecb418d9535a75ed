"""Regression tests of the engine core: stale prefix-cache entries, requests that could never
be scheduled, a failing step, per-request runner state, and request ids of `n > 1`.

Each test drives the real engine (scheduler, KV cache, runner, model) on a small
random-weight checkpoint and compares with a run that cannot have the defect.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvferry.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvferry.engine.core.request import RequestStatus
from kvferry.engine.frontend.llm_engine import LLMEngine
from kvferry.engine.frontend.outputs import RequestOutput
from kvferry.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> Path:
    return make_checkpoint("LlamaForCausalLM")


def make_engine(
    checkpoint: Path,
    *,
    num_blocks: int,
    max_model_len: int | None = None,
    max_num_batched_tokens: int = 8,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    policy: str = "fcfs",
    max_num_seqs: int = 16,
) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(
            model=str(checkpoint),
            max_model_len=(num_blocks - 1) * BLOCK_SIZE if max_model_len is None else max_model_len,
        ),
        cache=CacheConfig(
            block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching,
            num_gpu_blocks_override=num_blocks,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill, policy=policy,  # type: ignore[arg-type]
        ),
        device="cpu",
    ))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_to_completion(engine: LLMEngine, max_steps: int = 500) -> dict[str, RequestOutput]:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def assert_idle(engine: LLMEngine) -> None:
    """Every block back in the pool and no per-request state left in the runner."""
    assert engine.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks - 1
    # The runner hears of finished requests at the next step; an empty one delivers it.
    assert engine.step() == []
    assert engine.runner.num_tracked_requests == 0
    assert engine.get_num_unfinished_requests() == 0


# ---------------------------------------------------------------- stale prefix-cache blocks
# Arrivals (step -> [(id, prompt, max_tokens, arrival_time)]) under the priority policy with
# equal priorities, so the latest arrival is the preemption victim. At step 4, r3 (one
# block, whose last slot that step would fill) is scheduled first and then preempted when
# r2 cannot grow; allocating at step 4 used to index r3's block under the hash of tokens
# whose KV was never written.
STALE_BLOCK_ARRIVALS = {
    1: [("r3", [4], 14, 3.0)],
    2: [("r0", [4, 4, 3, 4, 5, 3, 5, 3, 3, 3], 4, 0.0),
        ("r2", [3, 3, 4, 4, 4, 5, 3, 5, 5, 5, 5, 4, 5, 5, 5, 4, 3], 1, 2.0)],
    4: [("r1", [3, 3, 5], 14, 1.0)],
}
PROBE_STEP = 4


def _run_stale_block_scenario(
    checkpoint: Path, enable_prefix_caching: bool, r3_outputs: list[int]
) -> dict[str, RequestOutput]:
    engine = make_engine(
        checkpoint, num_blocks=6, policy="priority", enable_prefix_caching=enable_prefix_caching
    )
    finished: dict[str, RequestOutput] = {}
    for step in range(PROBE_STEP + 1):
        for req_id, prompt, max_tokens, arrival in STALE_BLOCK_ARRIVALS.get(step, []):
            engine.add_request(req_id, {"prompt_token_ids": prompt}, greedy(max_tokens),
                               arrival_time=arrival, priority=1)
        if step == PROBE_STEP:
            # Starts with r3's first block: its prompt and its first three outputs.
            probe = [4, *r3_outputs[:3], 5, 5]
            engine.add_request("probe", {"prompt_token_ids": probe}, greedy(6),
                               arrival_time=-1.0, priority=0)
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.stats.scheduler.num_preemptions > 0
    finished.update(run_to_completion(engine))
    assert_idle(engine)
    return finished


def test_a_request_preempted_in_the_step_that_fills_a_block_leaves_it_uncached(
    checkpoint: Path,
) -> None:
    reference = _run_stale_block_scenario(checkpoint, False, [0, 0, 0])
    r3_outputs = reference["r3"].outputs[0].token_ids
    expected = _run_stale_block_scenario(checkpoint, False, r3_outputs)
    cached = _run_stale_block_scenario(checkpoint, True, r3_outputs)
    for req_id, output in expected.items():
        assert cached[req_id].outputs[0].token_ids == output.outputs[0].token_ids, req_id


def test_requests_sharing_a_prefix_that_arrive_together_compute_it_once(
    checkpoint: Path,
) -> None:
    engine = make_engine(checkpoint, num_blocks=32, max_num_batched_tokens=64)
    prefix = list(range(10, 42))  # 8 full blocks
    engine.add_request("a", {"prompt_token_ids": prefix + [50]}, greedy(2))
    engine.add_request("b", {"prompt_token_ids": prefix + [60]}, greedy(2))
    outputs = run_to_completion(engine)
    # b waited one step for a's blocks instead of computing them again.
    assert outputs["b"].num_cached_tokens == len(prefix)
    alone = make_engine(checkpoint, num_blocks=32, max_num_batched_tokens=64,
                        enable_prefix_caching=False)
    alone.add_request("b", {"prompt_token_ids": prefix + [60]}, greedy(2))
    assert run_to_completion(alone)["b"].outputs[0].token_ids == outputs["b"].outputs[0].token_ids


# ---------------------------------------------------------------- requests that cannot fit
def test_a_pool_smaller_than_one_max_len_sequence_is_refused_at_start(checkpoint: Path) -> None:
    # Two usable blocks of 4 tokens: 8 slots for a 12-token sequence.
    with pytest.raises(ValueError, match=r"2 blocks of 4 tokens \(8 tokens\), fewer than "
                                         r"max_model_len=12.*num_gpu_blocks_override"):
        make_engine(checkpoint, num_blocks=3, max_model_len=12)
    import torch
    from kvferry.engine.core.engine_core import check_kv_cache_fits

    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        check_kv_cache_fits(3, CacheConfig(block_size=4), 12, torch.device("cpu"))
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        check_kv_cache_fits(3, CacheConfig(block_size=4), 12, torch.device("cuda"))
    check_kv_cache_fits(4, CacheConfig(block_size=4), 12, torch.device("cpu"))


def test_without_chunked_prefill_a_prompt_longer_than_a_step_is_refused(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, num_blocks=16, max_num_batched_tokens=8,
                         enable_chunked_prefill=False)
    engine.add_request("ok", {"prompt_token_ids": [5, 6, 7]}, greedy(3))
    with pytest.raises(ValueError, match="9 tokens, more than max_num_batched_tokens=8"):
        engine.add_request("long", {"prompt_token_ids": list(range(3, 12))}, greedy(3))
    engine.add_request("after", {"prompt_token_ids": [8, 9]}, greedy(3))
    outputs = run_to_completion(engine)
    assert sorted(outputs) == ["after", "ok"]
    assert_idle(engine)


def test_without_chunked_prefill_a_preempted_request_longer_than_a_step_resumes(
    checkpoint: Path,
) -> None:
    # Five usable blocks of 4; three requests growing to 4 + 12 tokens preempt each other,
    # and a resumed request's recompute (prompt + outputs) is longer than the 8-token step.
    # Without prefix caching, so the recompute gets no cache hits that would shorten it.
    engine = make_engine(checkpoint, num_blocks=6, max_model_len=20, max_num_batched_tokens=8,
                         enable_chunked_prefill=False, enable_prefix_caching=False)
    prompts = {f"r{i}": list(range(10 + 4 * i, 14 + 4 * i)) for i in range(3)}
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, {"prompt_token_ids": prompt}, greedy(12))
    outputs = run_to_completion(engine)
    assert engine.stats.scheduler.num_preemptions > 0
    assert_idle(engine)
    for req_id, prompt in prompts.items():
        alone = make_engine(checkpoint, num_blocks=16, max_model_len=20)
        alone.add_request(req_id, {"prompt_token_ids": prompt}, greedy(12))
        expected = run_to_completion(alone)[req_id].outputs[0].token_ids
        assert outputs[req_id].outputs[0].token_ids == expected, req_id


# ---------------------------------------------------------------- a failing step
def test_stop_token_ids_outside_the_vocabulary_are_refused(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, num_blocks=16)
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[7, 256])
    with pytest.raises(ValueError, match=r"stop_token_ids\[1\] = 256 is outside the vocabulary"):
        engine.add_request("bad", {"prompt_token_ids": [5, 6]}, params)
    engine.add_request("good", {"prompt_token_ids": [5, 6]}, greedy(4))
    assert len(run_to_completion(engine)["good"].outputs[0].token_ids) == 4
    assert_idle(engine)


def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = {f"r{i}": [5 + i, 6 + i, 7 + i] for i in range(4)}
    clean = make_engine(checkpoint, num_blocks=16, max_num_seqs=2)
    for req_id, prompt in prompts.items():
        clean.add_request(req_id, {"prompt_token_ids": prompt}, greedy(5))
    expected = run_to_completion(clean)

    engine = make_engine(checkpoint, num_blocks=16, max_num_seqs=2)
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, {"prompt_token_ids": prompt}, greedy(5))
    engine.step()
    engine.step()  # r0 and r1 are decoding; r2 and r3 wait for a free seat
    sampler = engine.runner.sampler

    def failing_sampler(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(engine.runner, "sampler", sampler)  # fails once
        raise RuntimeError("injected failure after the forward pass")

    monkeypatch.setattr(engine.runner, "sampler", failing_sampler)
    failed = {o.request_id: o for o in engine.step()}
    assert sorted(failed) == ["r0", "r1"]
    for output in failed.values():
        assert output.finished and output.outputs[0].finish_reason == "error"
    outputs = run_to_completion(engine)
    assert sorted(outputs) == ["r2", "r3"]
    for req_id in ("r2", "r3"):
        assert outputs[req_id].outputs[0].token_ids == expected[req_id].outputs[0].token_ids
    assert_idle(engine)
    # The engine serves new requests as before.
    engine.add_request("again", {"prompt_token_ids": prompts["r0"]}, greedy(5))
    again = run_to_completion(engine)["again"]
    assert again.outputs[0].token_ids == expected["r0"].outputs[0].token_ids


# ---------------------------------------------------------------- per-request runner state
def _sampled(engine: LLMEngine, req_id: str, seed: int) -> list[int]:
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True)
    engine.add_request(req_id, {"prompt_token_ids": [5, 6, 7]}, params)
    return run_to_completion(engine)[req_id].outputs[0].token_ids


def test_an_aborted_preempted_request_leaves_no_generator_behind(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, num_blocks=6, max_model_len=20)
    engine.add_request("a", {"prompt_token_ids": list(range(10, 18))}, greedy(12))
    seeded = SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    engine.add_request("x", {"prompt_token_ids": list(range(30, 38))}, seeded)
    for _ in range(50):
        engine.step()
        request = engine.scheduler.requests.get("x")
        if request is not None and request.status == RequestStatus.PREEMPTED:
            break
    else:
        raise AssertionError("x was never preempted")
    engine.abort_request("x")
    run_to_completion(engine)
    fresh = make_engine(checkpoint, num_blocks=6, max_model_len=20)
    assert _sampled(engine, "x", seed=2) == _sampled(fresh, "x", seed=2)
    assert_idle(engine)


def test_a_reused_request_id_starts_a_fresh_generator(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, num_blocks=16)
    fresh = make_engine(checkpoint, num_blocks=16)
    first = _sampled(engine, "x", seed=3)
    assert _sampled(engine, "x", seed=3) == first == _sampled(fresh, "y", seed=3)
    assert_idle(engine)


# ---------------------------------------------------------------- n > 1 request ids
def test_child_ids_of_n_requests_cannot_collide_with_user_ids(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, num_blocks=32)
    engine.add_request("abc", {"prompt_token_ids": [5, 6]}, SamplingParams(
        n=2, temperature=1.0, seed=4, max_tokens=3, ignore_eos=True))
    for user_id in ("0_abc", "1_abc", "abc_0", "abc0"):
        engine.add_request(user_id, {"prompt_token_ids": [7, 8]}, greedy(3))
    with pytest.raises(ValueError, match="NUL"):
        engine.add_request("abc\x000", {"prompt_token_ids": [7, 8]}, greedy(3))
    outputs = run_to_completion(engine)
    assert sorted(outputs) == ["0_abc", "1_abc", "abc", "abc0", "abc_0"]
    assert [c.index for c in outputs["abc"].outputs] == [0, 1]
    assert all(len(c.token_ids) == 3 for c in outputs["abc"].outputs)
    assert_idle(engine)
