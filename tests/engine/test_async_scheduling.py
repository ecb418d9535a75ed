"""Async scheduling through the whole engine on CPU: outputs equal the synchronous loop's.

Each test runs the same requests through two engines on the same small random-weight
checkpoint, one with `async_scheduling`, and compares them token for token (greedy and
seeded sampling; seeded noise depends only on the seed and the output index, never on the
batch): mixed batches with chunked prefill, prefix hits, stop tokens and strings, EOS
under min_tokens, max_tokens, n > 1, logprobs, prompt logprobs and penalties; preemption;
aborts mid-run; structured outputs; an encoder-decoder model. Every block is back in the
pool afterwards. Other tests look at the overlap itself: the decode behind a step reads
that step's token from its sampled tensor, and a request that stops drops the token of
the step behind it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvferry.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvferry.engine.frontend.llm_engine import LLMEngine
from kvferry.engine.frontend.outputs import RequestOutput
from kvferry.engine.runner.async_output import PENDING_TOKEN_ID
from kvferry.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvferry_testing.compare_outputs import assert_same_outputs

BLOCK_SIZE = 4
EOS = 2


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("LlamaForCausalLM")


def make_engine(model: Path, async_scheduling: bool, *, num_blocks: int = 96,
                max_model_len: int = 64, max_num_batched_tokens: int = 16,
                max_num_seqs: int = 16, **model_fields: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(model), max_model_len=max_model_len, **model_fields),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  async_scheduling=async_scheduling),
        device="cpu",
    ))


Request = tuple[str, Any, SamplingParams]


def run(engine: LLMEngine, requests: list[Request],
        abort_after: dict[str, int] | None = None) -> dict[str, RequestOutput]:
    """Adds the requests and steps to the end; `abort_after[id] = k` aborts a request once
    its first completion has k tokens. Returns each request's last output."""
    for req_id, prompt, params in requests:
        engine.add_request(req_id, prompt, params)
    abort_after = dict(abort_after or {})
    last: dict[str, RequestOutput] = {}
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            last[output.request_id] = output
            if len(output.outputs[0].token_ids) >= abort_after.get(output.request_id, 1 << 30):
                del abort_after[output.request_id]
                for aborted in engine.abort_request(output.request_id):
                    last[aborted.request_id] = aborted
    else:
        raise AssertionError("requests left after 400 steps")
    return last


def assert_idle(engine: LLMEngine) -> None:
    """Every block back in the pool, nothing in flight, no runner state left."""
    assert engine.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks - 1
    assert engine.step() == []  # delivers the last finished ids to the runner
    assert not engine.has_unfinished_requests()
    assert engine.runner.num_tracked_requests == 0
    assert not engine.runner.pending
    in_flight = engine.scheduler.in_flight
    assert in_flight is None or len(in_flight) == 0


def both_ways(model: Path, requests: Callable[[], list[Request]], **engine_args: Any
              ) -> tuple[dict[str, RequestOutput], LLMEngine]:
    """Runs the requests synchronously and with async scheduling; checks they agree and
    that both engines end idle. Returns the outputs and the async engine."""
    abort_after = engine_args.pop("abort_after", None)
    outputs = {}
    engines = {}
    for async_scheduling in (False, True):
        engine = make_engine(model, async_scheduling, **engine_args)
        outputs[async_scheduling] = run(engine, requests(), abort_after)
        assert_idle(engine)
        engines[async_scheduling] = engine
    assert_same_outputs(outputs[False], outputs[True])
    return outputs[True], engines[True]


def greedy(max_tokens: int, **fields: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **fields)


def reference_tokens(model: Path, prompt: list[int], max_tokens: int) -> list[int]:
    engine = make_engine(model, False)
    return run(engine, [("ref", {"prompt_token_ids": prompt}, greedy(max_tokens,
                                                                     ignore_eos=True))])[
        "ref"].outputs[0].token_ids


# ---------------------------------------------------------------------- equal outputs
def test_a_mixed_batch_equals_the_synchronous_loop(checkpoint: Path) -> None:
    prefix = list(range(10, 26))  # four full blocks, shared by two requests
    stop_prompt = [40, 41, 42, 43, 44]
    ref = reference_tokens(checkpoint, stop_prompt, 12)

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
            # Stops at the token it samples fourth (or earlier, where that token comes
            # first), with the steps behind it in flight.
            ("stop-token", {"prompt_token_ids": stop_prompt},
             greedy(12, stop_token_ids=[ref[3]], ignore_eos=True)),
            # The front end finds the stop string and aborts the request in the core.
            ("stop-string", {"prompt_token_ids": stop_prompt},
             greedy(12, stop=[f"w{ref[4]}"], ignore_eos=True)),
            ("max1", {"prompt_token_ids": [60, 61, 62]}, greedy(1, ignore_eos=True)),
            ("logprobs", {"prompt_token_ids": [70, 71, 72, 73]},
             greedy(5, logprobs=3, prompt_logprobs=2, ignore_eos=True)),
            # EOS is favoured but held back until 3 outputs: a step in flight counts.
            ("eos", {"prompt_token_ids": [80, 81]},
             greedy(10, min_tokens=3, logit_bias={EOS: 30.0})),
            # Penalties count outputs on the host: these steps wait for the tokens.
            ("penalties", {"prompt_token_ids": [100, 101, 102]}, greedy(
                8, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                ignore_eos=True)),
        ]

    outputs, _ = both_ways(checkpoint, requests)
    assert len(outputs["chunked"].outputs[0].token_ids) == 8
    assert outputs["prefix-b"].num_cached_tokens == len(prefix)  # waited for a's blocks
    assert outputs["stop-token"].outputs[0].finish_reason == "stop"
    assert len(outputs["stop-token"].outputs[0].token_ids) <= 4
    assert outputs["stop-string"].outputs[0].stop_reason == f"w{ref[4]}"
    assert len(outputs["max1"].outputs[0].token_ids) == 1
    assert outputs["eos"].outputs[0].token_ids[3:] == [EOS]  # the first allowed position
    assert len(outputs["n3"].outputs) == 3
    assert len({tuple(c.token_ids) for c in outputs["n3"].outputs}) == 3


def test_preemption_equals_the_synchronous_loop(checkpoint: Path) -> None:
    # 12 usable blocks of 4 for six requests growing to 20 tokens each: they preempt each
    # other, also while the step sampling a victim's token is in flight.
    def requests() -> list[Request]:
        return [(f"r{i}", {"prompt_token_ids": list(range(20 + 9 * i, 28 + 9 * i))},
                 greedy(12, ignore_eos=True) if i % 2 else SamplingParams(
                     temperature=1.0, seed=i, max_tokens=12, ignore_eos=True))
                for i in range(6)]

    _, engine = both_ways(checkpoint, requests, num_blocks=13, max_model_len=24)
    assert engine.stats.scheduler.num_preemptions > 0


def test_aborts_mid_run_equal_the_synchronous_loop(checkpoint: Path) -> None:
    def requests() -> list[Request]:
        return [(f"r{i}", {"prompt_token_ids": [30 + i, 31 + i, 32 + i]},
                 greedy(10, ignore_eos=True)) for i in range(5)]

    outputs, _ = both_ways(checkpoint, requests, abort_after={"r1": 1, "r3": 4})
    assert [len(outputs[r].outputs[0].token_ids) for r in ("r1", "r3")] == [1, 4]
    assert outputs["r1"].outputs[0].finish_reason == "abort"
    assert len(outputs["r0"].outputs[0].token_ids) == 10


def test_structured_outputs_equal_the_synchronous_loop(demo_checkpoint: Path) -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "n"], "additionalProperties": False}

    def requests() -> list[Request]:
        constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=(
            StructuredOutputsParams(json=schema)))
        seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=40,
                                structured_outputs=StructuredOutputsParams(
                                    regex="(yes|no|maybe) [0-9]{1,3}"))
        return [("json-a", "Hello there", constrained), ("json-b", "x", constrained),
                ("json-c", "Hello world", constrained), ("json-d", "y", constrained),
                ("regex", "Answer:", seeded),
                ("free", "The river", SamplingParams(temperature=0.0, max_tokens=12))]

    # 17 usable blocks of 4 for six requests of 13 to 30 tokens (35 blocks): they preempt
    # each other, constrained ones too (their grammars keep their place).
    outputs, engine = both_ways(demo_checkpoint, requests, num_blocks=18, max_model_len=64,
                                max_num_batched_tokens=64, dtype="float32")
    assert engine.stats.scheduler.num_preemptions > 0
    for req_id in ("json-a", "json-b", "json-c", "json-d"):
        value = json.loads(outputs[req_id].outputs[0].text)
        assert set(value) == {"name", "n"}


def test_an_encoder_decoder_model_equals_the_synchronous_loop(tmp_path_factory) -> None:
    from kvferry_testing.encdec_checkpoints import make_bart_checkpoint

    bart = make_bart_checkpoint(tmp_path_factory.mktemp("bart"), seed=3)
    rng = np.random.default_rng(2)
    # Encoder inputs of different lengths (two identical: the second takes the first's
    # cross blocks from the cache) and decoder prompts long enough to be chunked.
    encoders = [[0, *rng.integers(4, 500, size=n).tolist(), 2] for n in (5, 30, 0, 55)]
    encoders[2] = encoders[1]
    decoders = [[2, 0, *rng.integers(4, 500, size=n).tolist()] for n in (0, 14, 3, 25)]

    def requests() -> list[Request]:
        return [(f"e{i}", {"encoder_prompt": {"prompt_token_ids": enc},
                           "decoder_prompt": {"prompt_token_ids": dec}},
                 greedy(10, ignore_eos=True) if i % 2 else SamplingParams(
                     temperature=1.0, seed=i, max_tokens=10, ignore_eos=True))
                for i, (enc, dec) in enumerate(zip(encoders, decoders))]

    # 45 usable blocks: one sequence of 48 tokens with the longest cross table (128
    # positions) fits; the four requests (49 blocks in all) preempt each other.
    _, engine = both_ways(bart, requests, num_blocks=46, max_model_len=48,
                          max_num_batched_tokens=12, dtype="float32")
    assert engine.stats.scheduler.num_preemptions > 0
    manager = engine.kv_cache_manager
    assert not manager.req_to_cross_blocks and not manager.req_to_blocks


# ---------------------------------------------------------------------- the overlap itself
def test_the_decode_behind_a_step_reads_its_token_from_the_sampled_tensor(
    checkpoint: Path,
) -> None:
    prompt = [5, 6, 7, 8, 9]
    expected = reference_tokens(checkpoint, prompt, 4)
    engine = make_engine(checkpoint, True)
    engine.add_request("r", {"prompt_token_ids": prompt}, greedy(4, ignore_eos=True))
    assert engine.step() == []  # the prefill is launched; nothing has come back yet
    runner, request = engine.runner, engine.scheduler.requests["r"]
    row = runner.input_batch.req_id_to_index["r"]
    # Its first token is still on the device: the host holds a placeholder for it.
    assert request.num_output_placeholders == 1 and request.output_token_ids == []
    assert runner.input_batch.token_ids.np[row, len(prompt)] == PENDING_TOKEN_ID
    assert runner.requests["r"].output_token_ids == [PENDING_TOKEN_ID]
    [first] = engine.step()  # launches the decode of that token, then reads the prefill's
    assert first.outputs[0].token_ids == expected[:1]
    assert request.num_output_placeholders == 1  # the decode's token is in flight
    assert runner.input_batch.token_ids.np[row, len(prompt)] == expected[0]
    assert runner.input_batch.token_ids.np[row, len(prompt) + 1] == PENDING_TOKEN_ID
    outputs = run(engine, [])
    assert outputs["r"].outputs[0].token_ids == expected
    assert_idle(engine)


def test_a_request_that_stops_drops_the_token_of_the_step_behind_it(checkpoint: Path) -> None:
    prompt = [40, 41, 42, 43, 44]
    ref = reference_tokens(checkpoint, prompt, 12)
    stop = ref[2]
    engine = make_engine(checkpoint, True)
    engine.add_request("r", {"prompt_token_ids": prompt},
                       greedy(12, stop_token_ids=[stop], ignore_eos=True))
    for _ in range(20):
        outputs = engine.step()
        if outputs and outputs[0].finished:
            break
    [output] = outputs
    assert output.outputs[0].token_ids == ref[:ref.index(stop) + 1]
    # The step behind the stop computed a row for it; its token goes nowhere.
    behind, _ = engine.engine_core._in_flight
    assert behind.num_scheduled_tokens == {"r": 1}
    assert engine.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks - 1
    assert engine.step() == []
    assert_idle(engine)


def test_a_reused_request_id_gets_none_of_the_old_requests_tokens(checkpoint: Path) -> None:
    prompt = [40, 41, 42, 43, 44]
    ref = reference_tokens(checkpoint, prompt, 12)
    # Longer than the old request got: its positions cover those of the old tokens.
    fresh_prompt = list(range(90, 102))
    expected = reference_tokens(checkpoint, fresh_prompt, 5)
    engine = make_engine(checkpoint, True)
    engine.add_request("x", {"prompt_token_ids": prompt},
                       greedy(12, stop_token_ids=[ref[1]], ignore_eos=True))
    while not any(o.finished for o in engine.step()):
        pass
    assert engine.engine_core._in_flight is not None  # x's row is in the step behind
    outputs = run(engine, [("x", {"prompt_token_ids": fresh_prompt},
                            greedy(5, ignore_eos=True))])
    assert outputs["x"].outputs[0].token_ids == expected
    assert_idle(engine)


def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts = {f"r{i}": [5 + i, 6 + i, 7 + i] for i in range(4)}
    expected = {r: reference_tokens(checkpoint, p, 5) for r, p in prompts.items()}
    engine = make_engine(checkpoint, True, max_num_seqs=2)
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, {"prompt_token_ids": prompt}, greedy(5, ignore_eos=True))
    engine.step()
    engine.step()  # r0 and r1 decode, one step in flight; r2 and r3 wait for a seat
    sampler = engine.runner.sampler

    def failing_sampler(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(engine.runner, "sampler", sampler)  # fails once
        raise RuntimeError("injected failure after the forward pass")

    monkeypatch.setattr(engine.runner, "sampler", failing_sampler)
    outputs = engine.step()
    # The step in flight comes back (a token each), then the launched one fails.
    assert [(o.request_id, o.finished) for o in outputs] == [("r0", True), ("r1", True)]
    for output in outputs:
        assert output.outputs[0].finish_reason == "error"
        assert output.outputs[0].token_ids == expected[output.request_id][:2]
    rest = run(engine, [])
    for req_id in ("r2", "r3"):
        assert rest[req_id].outputs[0].token_ids == expected[req_id]
    assert_idle(engine)


def test_an_input_no_step_in_flight_can_fill_fails_its_step_clearly(
    checkpoint: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    engine = make_engine(checkpoint, True)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, greedy(6, ignore_eos=True))
    engine.add_request("s", {"prompt_token_ids": [8, 9]}, greedy(6, ignore_eos=True))
    engine.step()
    # Lose track of where the step in flight's tokens go: the next decodes' inputs are
    # tokens no step in flight fills.
    [step] = engine.runner.pending.steps
    step.positions = step.positions + 1
    with caplog.at_level("ERROR"):
        outputs = {o.request_id: o for o in engine.step()}
    assert "come from a step in flight: the batch is inconsistent" in caplog.text
    assert {r: o.outputs[0].finish_reason for r, o in outputs.items()} == {
        "r": "error", "s": "error"}
    run(engine, [])
    assert_idle(engine)


def test_the_option_reaches_the_scheduler(checkpoint: Path) -> None:
    from kvferry.engine.frontend.llm import LLM

    llm = LLM(str(checkpoint), max_model_len=64, device="cpu", async_scheduling=True,
              num_gpu_blocks_override=32, block_size=BLOCK_SIZE)
    assert llm.llm_engine.scheduler.in_flight is not None
    sync = make_engine(checkpoint, False)
    assert sync.scheduler.in_flight is None
    out = llm.generate([[5, 6, 7]], greedy(4, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference_tokens(checkpoint, [5, 6, 7], 4)


def test_a_penalty_step_reads_the_previous_step_back_between_forward_and_sampling(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def requests() -> list[Request]:
        return [("p", {"prompt_token_ids": [5, 6, 7]},
                 greedy(8, repetition_penalty=1.5, frequency_penalty=0.3, ignore_eos=True)),
                ("q", {"prompt_token_ids": [9, 10]}, greedy(8, ignore_eos=True))]

    expected = run(make_engine(checkpoint, False), requests())
    engine = make_engine(checkpoint, True)
    runner = engine.runner
    order: list[str] = []
    for name in ("forward_async", "sample_async"):
        method = getattr(runner, name)
        monkeypatch.setattr(runner, name, lambda *a, _m=method, _n=name, **k: (
            order.append(f"{_n} pending={len(runner.pending.steps)}"), _m(*a, **k))[1])
    outputs = run(engine, requests())
    assert_same_outputs(expected, outputs)
    # Every forward pass is launched with the previous step in flight; its sampling only
    # once that step was read back (the penalties count its token on the host).
    decode_steps = order[2:-2]
    assert decode_steps[::2] == ["forward_async pending=1"] * (len(decode_steps) // 2)
    assert decode_steps[1::2] == ["sample_async pending=0"] * (len(decode_steps) // 2)
    assert_idle(engine)


def test_the_runner_alone_waits_for_the_pending_tokens_a_penalty_row_counts(
    checkpoint: Path,
) -> None:
    prompt = [5, 6, 7]
    params = greedy(4, repetition_penalty=1.5, ignore_eos=True)
    expected = run(make_engine(checkpoint, False), [("p", {"prompt_token_ids": prompt},
                                                      params)])["p"].outputs[0].token_ids
    engine = make_engine(checkpoint, True)
    engine.add_request("p", {"prompt_token_ids": prompt}, params)
    scheduler, runner = engine.scheduler, engine.runner
    first_step = scheduler.schedule()
    first = runner.execute_model_async(first_step)
    second_step = scheduler.schedule()
    second = runner.execute_model_async(second_step)  # the penalty reads the first's token
    state = runner.requests["p"]
    assert state.output_token_ids == [expected[0], PENDING_TOKEN_ID]
    assert len(runner.pending.steps) == 1
    assert first.result().sampled_token_ids == expected[:1]
    assert second.result().sampled_token_ids == expected[1:2]
    scheduler.update_from_output(first_step, first.result())
    scheduler.update_from_output(second_step, second.result())
    assert scheduler.requests["p"].output_token_ids == expected[:2]
