"""The microbatch loop (engine_core._step_microbatches) at its edges, through the real model
runner in a simulated pipeline of P stages: aborts of requests in flight (and their ids
taken again at once), stops, stop strings, min_tokens, n > 1, logprobs and prompt
logprobs, structured outputs, preemption storms, prefix hits across microbatches, an
encoder-decoder model, microbatches that fail (in the runner, in their future, at
submit), max_num_seqs per microbatch, P = 1 through the same loop, and random workloads.

Each test runs the same requests through the synchronous engine on the same random
checkpoint and compares token for token; the `Recorder` (kvferry_testing.microbatches)
checks at every submit that decodes are disjoint, rows fit the runner's batch and prefix
hits were written by updated steps. Every block is back in the pool afterwards. Some
tests also run a `LatePipeline`, which computes each step after later ones were
scheduled, as a real pipeline's stages do (the simulated one computes at submit).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kvferry.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvferry.engine.core.request import RequestStatus
from kvferry.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvferry.engine.executor.base import Executor, InProcessExecutor
from kvferry.engine.frontend.llm_engine import LLMEngine
from kvferry.engine.frontend.outputs import RequestOutput
from kvferry.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvferry_testing.compare_outputs import assert_same_output
from kvferry_testing.microbatches import (
    ExecutorWrapper,
    LatePipeline,
    Recorder,
    install_recorder,
)

BLOCK_SIZE = 4
EOS = 2
STAGE_SECONDS = 0.001

Request = tuple[str, Any, SamplingParams]
# Called after each step with the engine, the step's index and its outputs.
OnStep = Callable[[LLMEngine, int, list[RequestOutput]], None]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("LlamaForCausalLM")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """The models here are tiny: a second intra-op thread only adds a barrier to every
    small matmul, which on a busy machine of two cores makes a step up to a hundred times
    slower. Both engines of a comparison run alike; the loop is what is under test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_engine(model: Path, batches: int, *, num_blocks: int = 64, max_model_len: int = 64,
                max_num_batched_tokens: int = 16, max_num_seqs: int = 8,
                **model_fields: Any) -> tuple[LLMEngine, Recorder | None]:
    """An engine with `batches` microbatches in flight through a recorded simulated
    pipeline (no recorder for the synchronous engine, batches=1)."""
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(model), max_model_len=max_model_len, **model_fields),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  max_concurrent_batches=batches),
        device="cpu",
    ))
    recorder = None
    if batches > 1:
        recorder = install_recorder(engine.engine_core, batches, STAGE_SECONDS,
                                    max_rows=max_num_seqs)
    return engine, recorder


def run(engine: LLMEngine, requests: list[Request], on_step: OnStep | None = None,
        max_steps: int = 600) -> dict[str, RequestOutput]:
    """Adds the requests and steps until nothing is left; returns each request's last
    output (a request id taken again keeps the last one's)."""
    for req_id, prompt, params in requests:
        engine.add_request(req_id, prompt, params)
    last: dict[str, RequestOutput] = {}
    for index in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        outputs = engine.step()
        for output in outputs:
            last[output.request_id] = output
        if on_step is not None:
            on_step(engine, index, outputs)
    else:
        raise AssertionError(f"requests left after {max_steps} steps")
    return last


def assert_idle(engine: LLMEngine) -> None:
    """Every block back in the pool, nothing in flight, no runner state left."""
    assert engine.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks - 1
    assert engine.step() == []  # delivers the last finished ids to the runner
    assert not engine.has_unfinished_requests()
    assert engine.runner.num_tracked_requests == 0
    assert not engine.engine_core._microbatches
    in_flight = engine.scheduler.in_flight
    assert in_flight is None or len(in_flight) == 0


def both_ways(model: Path, requests: Callable[[], list[Request]], batches: int,
              cached_tokens: bool = True, **engine_args: Any
              ) -> tuple[dict[str, RequestOutput], LLMEngine, Recorder]:
    """Runs the requests synchronously and with `batches` microbatches in flight; checks
    that they agree and that both engines end idle. Returns the microbatch engine's
    outputs, the engine and its recorder."""
    expected_engine, _ = make_engine(model, 1, **engine_args)
    expected = run(expected_engine, requests())
    assert_idle(expected_engine)
    engine, recorder = make_engine(model, batches, **engine_args)
    assert recorder is not None
    outputs = run(engine, requests())
    assert_idle(engine)
    assert sorted(outputs) == sorted(expected)
    for req_id, want in expected.items():
        assert_same_output(outputs[req_id], want, req_id, cached_tokens)
    assert recorder.max_in_flight == batches
    return outputs, engine, recorder


def greedy(max_tokens: int, **fields: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **fields)


def tokens(start: int, num: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [3 + (start + i) % 250 for i in range(num)]}


def reference_tokens(model: Path, prompt: dict[str, list[int]], max_tokens: int) -> list[int]:
    engine, _ = make_engine(model, 1)
    return run(engine, [("ref", prompt, greedy(max_tokens, ignore_eos=True))])[
        "ref"].outputs[0].token_ids


def in_flight_ids(engine: LLMEngine) -> set[str]:
    """Requests computing in a microbatch the scheduler has not updated yet."""
    in_flight = engine.scheduler.in_flight
    assert in_flight is not None
    return {req_id for step in in_flight for req_id in step.output.num_scheduled_tokens}


# ---------------------------------------------------------------------- aborts
@pytest.mark.parametrize("batches", [2, 3])
def test_aborts_in_flight_and_ids_taken_again(checkpoint: Path, batches: int) -> None:
    """A prompt aborted while its next chunk is in flight, decodes aborted while their
    token is in flight, each id taken at once by a new request: the aborted ones keep a
    prefix of what they would have produced, no token of theirs reaches the newcomer,
    and the newcomers (one sharing the aborted prompt's cached prefix) produce what they
    would alone."""
    long_prompt = tokens(0, 45)  # chunks of 16, 16 and 13
    # The first two blocks of the aborted prompt are cached by then; its third is not.
    again_prompt = {"prompt_token_ids": long_prompt["prompt_token_ids"][:8] + [7, 8, 9, 10]}

    def requests() -> list[Request]:
        return [("long", long_prompt, greedy(6, ignore_eos=True)),
                *[(f"d{i}", tokens(60 + 7 * i, 3 + i), greedy(14, ignore_eos=True))
                  for i in range(4)]]

    newcomer = ("long", again_prompt, greedy(7, ignore_eos=True))
    # Decodes aborted take their ids again with these prompts, in turn.
    taking_ids = [tokens(120 + 20 * i, 5 + i) for i in range(2)]
    # What each request produces when nothing is aborted.
    reference_engine, _ = make_engine(checkpoint, 1)
    reference = run(reference_engine, [
        *requests(), ("long-again", *newcomer[1:]),
        *[(f"again{i}", prompt, greedy(9, ignore_eos=True))
          for i, prompt in enumerate(taking_ids)]])

    engine, recorder = make_engine(checkpoint, batches)
    aborted: dict[str, RequestOutput] = {}
    victims: list[str] = []

    def abort_in_flight(engine: LLMEngine, index: int, outputs: list[RequestOutput]) -> None:
        in_flight = in_flight_ids(engine)
        requests_now = engine.scheduler.requests
        if "long" not in aborted and "long" in in_flight:
            assert not requests_now["long"].output_token_ids  # a chunk is in flight
            [aborted["long"]] = engine.abort_request("long")
            engine.add_request(*newcomer)
        decoding = sorted(r for r in in_flight if r.startswith("d") and r not in aborted
                          and len(requests_now[r].output_token_ids) >= 2)
        if decoding and len(victims) < 2:
            victim = decoding[0]
            [aborted[victim]] = engine.abort_request(victim)
            # The same id at once, with another prompt.
            engine.add_request(victim, taking_ids[len(victims)], greedy(9, ignore_eos=True))
            victims.append(victim)

    outputs = run(engine, requests(), abort_in_flight)
    assert_idle(engine)
    assert recorder is not None and recorder.max_in_flight == batches
    assert "long" in aborted and len(victims) == 2, sorted(aborted)
    for req_id, output in aborted.items():
        completion = output.outputs[0]
        assert completion.finish_reason == "abort", req_id
        want = reference[req_id].outputs[0].token_ids
        assert completion.token_ids == want[:len(completion.token_ids)], req_id
    assert_same_output(outputs["long"], reference["long-again"], "long", cached_tokens=False)
    assert outputs["long"].num_cached_tokens == 8  # the aborted prompt's computed blocks
    for i, victim in enumerate(victims):
        assert_same_output(outputs[victim], reference[f"again{i}"], victim)
    for req_id in {f"d{i}" for i in range(4)} - set(victims):
        assert_same_output(outputs[req_id], reference[req_id], req_id)


# ---------------------------------------------------------------------- stops and params
@pytest.mark.parametrize("batches", [2, 3])
def test_stops_and_sampling_params_equal_the_synchronous_loop(
    checkpoint: Path, batches: int
) -> None:
    shared = tokens(10, 22)["prompt_token_ids"]  # five full blocks and a half
    stop_prompt = tokens(40, 5)
    ref = reference_tokens(checkpoint, stop_prompt, 12)

    def requests() -> list[Request]:
        return [
            # Stops at the token it samples fourth (or where that token comes earlier).
            ("stop-token", stop_prompt, greedy(12, stop_token_ids=[ref[3]], ignore_eos=True)),
            # The front end finds the stop string and aborts the request in the core.
            ("stop-string", stop_prompt, greedy(12, stop=[f"w{ref[4]}"], ignore_eos=True)),
            # EOS is favoured but held back until 3 outputs.
            ("eos", tokens(80, 2), greedy(10, min_tokens=3, logit_bias={EOS: 30.0})),
            # Its one token ends it: sampled by the last of three chunks.
            ("max1", tokens(90, 40), greedy(1, ignore_eos=True)),
            # n > 1 over a prompt longer than a chunk: the children's prefix comes from
            # the first one's blocks once its microbatches are updated.
            ("n3", {"prompt_token_ids": shared}, SamplingParams(
                n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)),
            ("n2-greedy", {"prompt_token_ids": shared + [200, 201]},
             SamplingParams(n=2, temperature=0.0, max_tokens=5, ignore_eos=True)),
            # Prompt logprobs of a prompt scored in three chunks; sampled logprobs.
            ("logprobs", tokens(150, 37), greedy(5, logprobs=3, prompt_logprobs=2,
                                                 ignore_eos=True)),
            ("seeded", tokens(7, 3), SamplingParams(
                temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True,
                logprobs=1)),
            ("penalties", tokens(100, 3), greedy(
                8, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                ignore_eos=True)),
        ]

    outputs, _, recorder = both_ways(checkpoint, requests, batches)
    assert outputs["stop-token"].outputs[0].finish_reason == "stop"
    assert outputs["stop-string"].outputs[0].stop_reason == f"w{ref[4]}"
    assert outputs["eos"].outputs[0].token_ids[3:] == [EOS]  # the first allowed position
    assert len(outputs["max1"].outputs[0].token_ids) == 1
    assert len({tuple(c.token_ids) for c in outputs["n3"].outputs}) == 3
    assert outputs["n3"].num_cached_tokens == 0  # the parent's count is its first child's
    assert len(outputs["logprobs"].prompt_logprobs) == 37
    assert recorder.overlapping_chunks > 0
    assert recorder.num_hit_blocks_checked > 0


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
                ("json-c", "Hello world, this prompt is long enough to be chunked",
                 constrained), ("json-d", "y", constrained),
                ("regex", "Answer:", seeded),
                ("free", "The river", SamplingParams(temperature=0.0, max_tokens=12))]

    # 17 usable blocks of 4 for six requests of 13 to 50 tokens: they preempt each other,
    # constrained ones too (their grammars keep their place).
    outputs, engine, _ = both_ways(demo_checkpoint, requests, 2, num_blocks=18,
                                   max_num_batched_tokens=8, dtype="float32")
    assert engine.stats.scheduler.num_preemptions > 0
    for req_id in ("json-a", "json-b", "json-c", "json-d"):
        value = json.loads(outputs[req_id].outputs[0].text)
        assert set(value) == {"name", "n"}


# ---------------------------------------------------------------------- preemption
@pytest.mark.parametrize("batches", [2, 3])
def test_preemption_storms_equal_the_synchronous_loop(checkpoint: Path, batches: int) -> None:
    """12 usable blocks for ten requests growing to 20-odd tokens: they preempt each
    other, also while a microbatch in flight samples the victim's token."""
    stop_prompt = tokens(20, 8)
    ref = reference_tokens(checkpoint, stop_prompt, 12)

    def requests() -> list[Request]:
        out: list[Request] = [
            (f"r{i}", tokens(20 + 9 * i, 8),
             greedy(12, ignore_eos=True) if i % 2 else SamplingParams(
                 temperature=1.0, seed=i, max_tokens=12 - i % 3, ignore_eos=True))
            for i in range(9)]
        out.append(("stop", stop_prompt, greedy(12, stop_token_ids=[ref[6]], ignore_eos=True)))
        return out

    _, engine, recorder = both_ways(checkpoint, requests, batches, cached_tokens=False,
                                    num_blocks=13, max_model_len=24)
    assert engine.stats.scheduler.num_preemptions > 0
    assert recorder.preempted_while_sampling


@pytest.mark.parametrize("ending", ["max_tokens", "stop_token"])
def test_a_request_ends_by_the_token_in_flight_when_it_was_preempted(
    checkpoint: Path, ending: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four usable blocks, two requests of five tokens: "a" needs a block while the
    microbatch sampling "b"'s last token (its fourth: max_tokens, or a stop token) is in
    flight, and preempts it; that token still ends "b", from the waiting queue, and every
    block comes back."""
    b_prompt = tokens(50, 5)
    ref = reference_tokens(checkpoint, b_prompt, 6)
    b_params = (greedy(4, ignore_eos=True) if ending == "max_tokens"
                else greedy(6, stop_token_ids=[ref[3]], ignore_eos=True))

    def requests() -> list[Request]:
        return [("a", tokens(10, 5), greedy(6, ignore_eos=True)), ("b", b_prompt, b_params)]

    engine, _ = make_engine(checkpoint, 2, num_blocks=5, max_model_len=16,
                            max_num_batched_tokens=8)
    scheduler = engine.scheduler
    end_taking_tokens = scheduler._end_taking_tokens
    ended_preempted: list[tuple[str, RequestStatus]] = []

    def spy(request: Any, status: RequestStatus) -> None:
        if request.status is RequestStatus.PREEMPTED:
            ended_preempted.append((request.request_id, status))
        end_taking_tokens(request, status)

    monkeypatch.setattr(scheduler, "_end_taking_tokens", spy)
    expected_engine, _ = make_engine(checkpoint, 1, num_blocks=5, max_model_len=16,
                                     max_num_batched_tokens=8)
    expected = run(expected_engine, requests())
    outputs = run(engine, requests())
    assert_idle(engine)
    status = (RequestStatus.FINISHED_LENGTH_CAPPED if ending == "max_tokens"
              else RequestStatus.FINISHED_STOPPED)
    assert ended_preempted == [("b", status)]
    assert outputs["b"].outputs[0].token_ids == ref[:4]
    for req_id, want in expected.items():
        assert_same_output(outputs[req_id], want, req_id, cached_tokens=False)


# ---------------------------------------------------------------------- prefix caching
@pytest.mark.parametrize("batches", [2, 3])
def test_prefix_hits_across_microbatches(checkpoint: Path, batches: int) -> None:
    """Requests sharing prefixes of several blocks arrive while the first ones' blocks
    are being computed in microbatches in flight: hits only on blocks whose microbatch
    was updated (the Recorder checks each), the same hits and tokens as the synchronous
    loop."""
    prefix = tokens(30, 20)["prompt_token_ids"]

    def requests() -> list[Request]:
        return [(f"p{i}", {"prompt_token_ids": prefix[:12 + 4 * (i % 3)] + [200 + i] * (i + 1)},
                 greedy(5, ignore_eos=True)) for i in range(7)]

    outputs, _, recorder = both_ways(checkpoint, requests, batches,
                                     max_num_batched_tokens=12)
    assert recorder.num_hit_blocks_checked > 0
    assert sum(o.num_cached_tokens for o in outputs.values()) > 0


# ---------------------------------------------------------------------- encoder-decoder
@pytest.mark.parametrize("late", [False, True], ids=["computed-at-submit", "computed-late"])
def test_an_encoder_decoder_model_equals_the_synchronous_loop(
    tmp_path_factory: pytest.TempPathFactory, late: bool
) -> None:
    """BART through three microbatches in flight: encoders run in the microbatch that
    admits their request, an encoder input shared by three requests is encoded once
    (the others wait for its cross blocks, then hit them), and preemption frees and
    brings back cross tables."""
    from kvferry_testing.encdec_checkpoints import make_bart_checkpoint

    bart = make_bart_checkpoint(tmp_path_factory.mktemp("bart"), seed=3)
    rng = np.random.default_rng(2)
    encoders = [[0, *rng.integers(4, 500, size=n).tolist(), 2] for n in (5, 30, 0, 55, 12, 0)]
    encoders[2] = encoders[5] = encoders[1]
    decoders = [[2, 0, *rng.integers(4, 500, size=n).tolist()] for n in (0, 14, 3, 25, 7, 2)]

    def requests() -> list[Request]:
        return [(f"e{i}", {"encoder_prompt": {"prompt_token_ids": enc},
                           "decoder_prompt": {"prompt_token_ids": dec}},
                 greedy(10, ignore_eos=True) if i % 2 else SamplingParams(
                     temperature=1.0, seed=i, max_tokens=10, ignore_eos=True))
                for i, (enc, dec) in enumerate(zip(encoders, decoders, strict=True))]

    # 45 usable blocks: one sequence of 48 tokens with the longest cross table fits.
    engine_args: dict[str, Any] = {"num_blocks": 46, "max_model_len": 48,
                                   "max_num_batched_tokens": 12, "dtype": "float32"}
    if late:
        expected_engine, _ = make_engine(bart, 1, **engine_args)
        expected = run(expected_engine, requests())
        engine = late_engine(bart, 3, **engine_args)
        outputs = run(engine, requests())
        assert_idle(engine)
        for req_id, want in expected.items():
            assert_same_output(outputs[req_id], want, req_id, cached_tokens=False)
    else:
        _, engine, _ = both_ways(bart, requests, 3, cached_tokens=False, **engine_args)
    assert engine.stats.scheduler.num_preemptions > 0
    manager = engine.kv_cache_manager
    assert not manager.req_to_cross_blocks and not manager.req_to_blocks


# ---------------------------------------------------------------------- failures
class FailOne(ExecutorWrapper):
    """Runs every step on `inner`, but the future of the first step `doomed` picks raises."""

    def __init__(self, inner: Executor, doomed: Callable[[SchedulerOutput], bool]) -> None:
        super().__init__(inner)
        self.doomed = doomed
        self.failed: SchedulerOutput | None = None

    def submit(self, scheduler_output: SchedulerOutput,
               grammar_bitmask: Any = None) -> Future[ModelRunnerOutput]:
        future = self.inner.submit(scheduler_output, grammar_bitmask)
        if self.failed is None and self.doomed(scheduler_output):
            self.failed = scheduler_output
            failed: Future[ModelRunnerOutput] = Future()
            failed.set_exception(RuntimeError("stage 2 lost its peer"))
            return failed
        return future


@pytest.mark.parametrize("batches", [2, 3])
def test_a_failed_microbatch_in_the_middle(checkpoint: Path, batches: int) -> None:
    """The fourth microbatch raises while others are in flight: its requests end with
    "error" (their tokens so far a prefix of what they would produce), the others produce
    what they would, and every block comes back."""

    def requests() -> list[Request]:
        return [(f"r{i}", tokens(9 * i, 3 + 5 * i), greedy(10, ignore_eos=True))
                for i in range(6)]

    expected_engine, _ = make_engine(checkpoint, 1)
    expected = run(expected_engine, requests())
    engine, recorder = make_engine(checkpoint, batches)
    assert recorder is not None
    counter = iter(range(1000))
    failing = FailOne(recorder.sampled.inner,
                      lambda so: so.total_num_scheduled_tokens > 0 and next(counter) == 3)
    recorder.sampled.inner = failing
    outputs = run(engine, requests())
    assert_idle(engine)
    assert failing.failed is not None
    failed_ids = set(failing.failed.num_scheduled_tokens)
    assert failed_ids and failed_ids != set(outputs)
    for req_id, want in expected.items():
        got = outputs[req_id]
        if req_id in failed_ids:
            completion = got.outputs[0]
            assert completion.finish_reason == "error", req_id
            want_tokens = want.outputs[0].token_ids
            assert completion.token_ids == want_tokens[:len(completion.token_ids)], req_id
        else:
            assert_same_output(got, want, req_id)


def test_a_failed_microbatch_spares_a_new_request_with_an_aborted_ones_id(
    checkpoint: Path,
) -> None:
    """A decode is aborted while the microbatch sampling it is in flight and its id is
    taken at once by a new request; that microbatch then fails. The failure ends what was
    in it, not the newcomer (nor does the newcomer see an output of the aborted one)."""
    engine, recorder = make_engine(checkpoint, 2)
    assert recorder is not None

    def decode_of_victim(so: SchedulerOutput) -> bool:
        request = engine.scheduler.requests.get("victim")
        return (request is not None and "victim" in so.num_scheduled_tokens
                and len(request.output_token_ids) >= 2)

    failing = FailOne(recorder.sampled.inner, decode_of_victim)
    recorder.sampled.inner = failing
    newcomer = (tokens(70, 6), greedy(8, ignore_eos=True))
    expected = reference_tokens(checkpoint, newcomer[0], 8)
    aborted: list[RequestOutput] = []

    def abort_and_take_the_id(engine: LLMEngine, index: int,
                              outputs: list[RequestOutput]) -> None:
        if not aborted and failing.failed is not None and "victim" in in_flight_ids(engine):
            aborted.extend(engine.abort_request("victim"))
            engine.add_request("victim", *newcomer)

    # Twelve tokens each in a budget of 16: the victim's prompt and the other's first
    # chunk, then the other's second chunk; their decodes alternate from then on.
    outputs = run(engine, [("victim", tokens(50, 12), greedy(12, ignore_eos=True)),
                           ("other", tokens(90, 12), greedy(12, ignore_eos=True))],
                  abort_and_take_the_id)
    assert_idle(engine)
    assert aborted and aborted[0].outputs[0].finish_reason == "abort"
    got = outputs["victim"]
    assert got.outputs[0].finish_reason == "length", got.outputs[0]
    assert got.outputs[0].token_ids == expected
    assert len(outputs["other"].outputs[0].token_ids) == 12


def test_a_simulated_pipeline_passes_recovery_and_released_embeds_on(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the engine tells its executor besides steps reaches the runner under a
    simulated pipeline: a failed step's recovery, and the prompt embeddings of requests
    that finished (on an idle engine no next step would drop them)."""
    from kvferry_testing.embeds import embedding_table

    engine, recorder = make_engine(checkpoint, 2, enable_prompt_embeds=True)
    assert recorder is not None
    runner = engine.runner
    recovered: list[list[str]] = []
    recover = runner.recover_from_failed_step

    def recording_recover(failed_req_ids: list[str]) -> None:
        recovered.append(list(failed_req_ids))
        recover(failed_req_ids)

    monkeypatch.setattr(runner, "recover_from_failed_step", recording_recover)
    recorder.sampled.inner = FailOne(recorder.sampled.inner,
                                     lambda so: "doomed" in so.num_scheduled_tokens)
    table = embedding_table(checkpoint)
    # The doomed prompt takes the first microbatch's whole budget of 16.
    outputs = run(engine, [
        ("doomed", tokens(5, 16), greedy(4, ignore_eos=True)),
        ("embeds", {"prompt_embeds": table[list(range(10, 30))]}, greedy(3, ignore_eos=True)),
    ])
    assert outputs["doomed"].outputs[0].finish_reason == "error"
    assert recovered == [["doomed"]]
    assert outputs["embeds"].outputs[0].finish_reason == "length"
    # The engine is idle; the runner still keeps the finished request's state (the next
    # step would drop it), but not its embeddings.
    assert runner.requests["embeds"].prompt_embeds is None
    assert_idle(engine)


# ---------------------------------------------------------------------- max_num_seqs
def test_max_num_seqs_bounds_each_microbatch(checkpoint: Path) -> None:
    """P = 2 and max_num_seqs = 4: eight requests decode at once, four in each
    microbatch, none ever with more rows than the runner's batch holds."""

    def requests() -> list[Request]:
        return [(f"s{i}", tokens(11 * i, 4 + i % 3), greedy(12, ignore_eos=True))
                for i in range(8)]

    engine, recorder = make_engine(checkpoint, 2, max_num_seqs=4, max_num_batched_tokens=32)
    assert recorder is not None
    num_running: list[int] = []
    outputs = run(engine, requests(),
                  lambda e, i, o: num_running.append(len(e.scheduler.running)))
    assert_idle(engine)
    assert max(num_running) == 8
    assert max(map(len, recorder.submitted)) == 4
    expected_engine, _ = make_engine(checkpoint, 1, max_num_seqs=4, max_num_batched_tokens=32)
    expected = run(expected_engine, requests())
    for req_id, want in expected.items():
        assert_same_output(outputs[req_id], want, req_id)


class FailsAtSubmit(ExecutorWrapper):
    """An executor that cannot send the first step with tokens that `doomed` picks (a
    transport that fails, a step that cannot be serialized): its `submit` raises, or
    (`how` "future") returns a future failed already; the others run on `inner`."""

    def __init__(self, inner: Executor, num_stages: int, how: str,
                 doomed: Callable[[SchedulerOutput], bool]) -> None:
        super().__init__(inner)
        self.max_concurrent_batches = num_stages
        self.how = how
        self.doomed = doomed
        self.failed: SchedulerOutput | None = None

    def submit(self, scheduler_output: SchedulerOutput,
               grammar_bitmask: Any = None) -> Future[ModelRunnerOutput]:
        if (self.failed is None and scheduler_output.total_num_scheduled_tokens
                and self.doomed(scheduler_output)):
            self.failed = scheduler_output
            error = ConnectionError("stage 1 is unreachable")
            if self.how == "raise":
                raise error
            failed: Future[ModelRunnerOutput] = Future()
            failed.set_exception(error)
            return failed
        return self.inner.submit(scheduler_output, grammar_bitmask)


@pytest.mark.parametrize("how", ["raise", "future"])
def test_a_microbatch_that_cannot_be_sent_fails_alone(checkpoint: Path, how: str) -> None:
    """A microbatch cannot be sent (its submit raises, or returns a failed future) with
    another in flight: the step still returns, the requests of the unsent microbatch end
    with "error", the others produce what they would, and the runner still hears of the
    requests that finished before (the unsent step was to tell it)."""

    def requests() -> list[Request]:
        return [(f"r{i}", tokens(9 * i, 3 + 5 * i), greedy(4 + 3 * i, ignore_eos=True))
                for i in range(5)]

    expected_engine, _ = make_engine(checkpoint, 1)
    expected = run(expected_engine, requests())
    engine, recorder = make_engine(checkpoint, 2)
    assert recorder is not None
    raising = FailsAtSubmit(recorder, 2, how, lambda so: bool(so.finished_req_ids))
    engine.engine_core.executor = raising
    outputs = run(engine, requests())
    assert_idle(engine)
    assert raising.failed is not None
    failed_ids = set(raising.failed.num_scheduled_tokens)
    assert failed_ids and failed_ids != set(outputs)
    for req_id, want in expected.items():
        if req_id in failed_ids:
            assert outputs[req_id].outputs[0].finish_reason == "error", req_id
        else:
            assert_same_output(outputs[req_id], want, req_id)


@pytest.mark.parametrize("how", ["raise", "future"])
def test_nothing_continues_a_microbatch_that_cannot_be_sent(checkpoint: Path, how: str) -> None:
    """The microbatch with a prompt's first chunk cannot be sent: it fails there and then,
    so no microbatch behind it carries that prompt's next chunk (with another request)
    to a runner that never saw the prompt."""

    def requests() -> list[Request]:
        # Budget 16: the long prompt's first chunk, then its last four tokens and the
        # other's prompt.
        return [("long", tokens(0, 20), greedy(5, ignore_eos=True)),
                ("other", tokens(40, 12), greedy(6, ignore_eos=True))]

    expected_engine, _ = make_engine(checkpoint, 1)
    expected = run(expected_engine, requests())
    engine, recorder = make_engine(checkpoint, 2)
    assert recorder is not None
    raising = FailsAtSubmit(
        recorder, 2, how, lambda so: any(new.req_id == "long" for new in so.scheduled_new_reqs))
    engine.engine_core.executor = raising
    outputs = run(engine, requests())
    assert_idle(engine)
    assert raising.failed is not None and set(raising.failed.num_scheduled_tokens) == {"long"}
    assert outputs["long"].outputs[0].finish_reason == "error"
    assert_same_output(outputs["other"], expected["other"], "other")


@pytest.mark.parametrize("late", [False, True], ids=["computed-at-submit", "computed-late"])
def test_a_runner_that_raises_mid_step(checkpoint: Path, late: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The model itself raises in the fourth of three microbatches in flight, after the
    runner took in that step's changes; the steps behind it were computed (or, computed
    late, are computed) on the runner it left, and may continue its prompts. Only the
    failed step's requests end with "error"; the others produce what they would."""

    def requests() -> list[Request]:
        return [(f"r{i}", tokens(9 * i, 3 + 5 * i), greedy(10, ignore_eos=True))
                for i in range(6)]

    expected_engine, _ = make_engine(checkpoint, 1)
    expected = run(expected_engine, requests())
    engine = late_engine(checkpoint, 3) if late else make_engine(checkpoint, 3)[0]
    runner = engine.runner
    forward, execute_model = runner.model.forward, runner.execute_model
    calls = iter(range(1000))
    failed: list[set[str]] = []

    def failing_forward(*args: Any, **kwargs: Any) -> Any:
        if next(calls) == 3:
            raise RuntimeError("a NaN check tripped")
        return forward(*args, **kwargs)

    def recording_execute_model(scheduler_output: SchedulerOutput, *args: Any) -> Any:
        try:
            return execute_model(scheduler_output, *args)
        except RuntimeError:
            failed.append(set(scheduler_output.num_scheduled_tokens))
            raise

    monkeypatch.setattr(runner.model, "forward", failing_forward)
    monkeypatch.setattr(runner, "execute_model", recording_execute_model)
    outputs = run(engine, requests())
    assert_idle(engine)
    [failed_ids] = failed
    assert failed_ids and failed_ids != set(outputs)
    for req_id, want in expected.items():
        got = outputs[req_id]
        if req_id in failed_ids:
            completion = got.outputs[0]
            assert completion.finish_reason == "error", req_id
            want_tokens = want.outputs[0].token_ids
            assert completion.token_ids == want_tokens[:len(completion.token_ids)], req_id
        else:
            assert_same_output(got, want, req_id)


# ---------------------------------------------------------------------- P = 1
def test_one_microbatch_in_flight_equals_the_synchronous_loop(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_concurrent_batches = 2 over the in-process executor, which takes one step at a
    time: the microbatch loop with P = 1 (its scheduler bookkeeping, its update path)
    gives what the synchronous step gives, and leaves nothing in flight between steps."""
    stop_prompt = tokens(40, 5)
    ref = reference_tokens(checkpoint, stop_prompt, 12)

    def requests() -> list[Request]:
        return [
            ("chunked", tokens(50, 35), greedy(8, ignore_eos=True)),
            ("prefix-a", tokens(10, 17), greedy(6, ignore_eos=True)),
            ("prefix-b", {"prompt_token_ids": tokens(10, 16)["prompt_token_ids"] + [91, 92]},
             greedy(6, ignore_eos=True)),
            ("n2", tokens(11, 2), SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=7,
                                                 ignore_eos=True)),
            ("stop-token", stop_prompt, greedy(12, stop_token_ids=[ref[3]], ignore_eos=True)),
            ("stop-string", stop_prompt, greedy(12, stop=[f"w{ref[4]}"], ignore_eos=True)),
            ("logprobs", tokens(70, 4), greedy(5, logprobs=3, prompt_logprobs=2,
                                               ignore_eos=True)),
            ("eos", tokens(80, 2), greedy(10, min_tokens=3, logit_bias={EOS: 30.0})),
        ]

    expected_engine, _ = make_engine(checkpoint, 1, num_blocks=24)
    num_steps: list[int] = []
    expected = run(expected_engine, requests(), lambda e, i, o: num_steps.append(i))
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(checkpoint), max_model_len=64),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=24),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16,
                                  max_concurrent_batches=2),
        device="cpu",
    ))
    core = engine.engine_core
    assert core.executor.max_concurrent_batches == 1
    loop = core._step_microbatches
    num_loops = []

    def counted() -> Any:
        num_loops.append(1)
        return loop()

    monkeypatch.setattr(core, "_step_microbatches", counted)
    outputs = run(engine, requests(),
                  lambda e, i, o: assert_nothing_in_flight(e))
    # The same schedule: as many steps as the synchronous loop took.
    assert len(num_loops) == len(num_steps)
    assert_idle(engine)
    assert expected_engine.stats.scheduler.num_preemptions > 0
    assert sorted(outputs) == sorted(expected)
    for req_id, want in expected.items():
        assert_same_output(outputs[req_id], want, req_id)


def assert_nothing_in_flight(engine: LLMEngine) -> None:
    assert not engine.engine_core._microbatches
    assert engine.scheduler.in_flight is not None and not len(engine.scheduler.in_flight)


# ---------------------------------------------------------------------- computed late
def late_engine(model: Path, batches: int, **engine_args: Any) -> LLMEngine:
    """An engine whose microbatches are computed after their submit (LatePipeline)."""
    engine, _ = make_engine(model, batches, **engine_args)
    core = engine.engine_core
    core.executor = LatePipeline(InProcessExecutor(core.runner), batches, STAGE_SECONDS)
    return engine


def test_grammars_in_flight_keep_their_own_bitmask(demo_checkpoint: Path) -> None:
    """Two microbatches of constrained requests in flight, computed after both were
    scheduled: each samples under its own grammar bitmask (the second's fill must not
    overwrite the first's), so the outputs are the synchronous loop's."""

    def requests() -> list[Request]:
        regex = StructuredOutputsParams(regex="(yes|no|maybe) [0-9]{1,3}")
        return [(f"g{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                 structured_outputs=regex))
                for i, prompt in enumerate(["Answer:", "x", "Hello there", "y"])]

    # Two rows a microbatch: the four requests take two microbatches, which alternate.
    expected_engine, _ = make_engine(demo_checkpoint, 1, max_num_seqs=2, dtype="float32")
    expected = run(expected_engine, requests())
    engine = late_engine(demo_checkpoint, 2, max_num_seqs=2, dtype="float32")
    outputs = run(engine, requests())
    assert_idle(engine)
    for req_id, want in expected.items():
        assert want.outputs[0].finish_reason == "stop", want
        assert_same_output(outputs[req_id], want, req_id)


def test_prompt_embeds_of_a_request_aborted_in_flight(checkpoint: Path) -> None:
    """A prompt of embeddings is aborted while a microbatch computing its chunk (with
    another request's decode) is in flight and not computed yet: that microbatch still
    finds the embeddings it reads, and the other request goes on."""
    from kvferry_testing.embeds import embedding_table

    table = embedding_table(checkpoint)
    other = ("other", tokens(60, 5), greedy(8, ignore_eos=True))
    expected = reference_tokens(checkpoint, other[1], 8)
    engine = late_engine(checkpoint, 2, enable_prompt_embeds=True)
    aborted: list[RequestOutput] = []

    def abort_with_other_in_flight(engine: LLMEngine, index: int,
                                   outputs: list[RequestOutput]) -> None:
        if not aborted and {"embeds", "other"} <= in_flight_ids(engine):
            aborted.extend(engine.abort_request("embeds"))

    # Budget 16: the other's prompt and the first chunk of the embeddings, then their
    # second chunk, then their third chunk with the other's first decode.
    outputs = run(engine, [other, ("embeds", {"prompt_embeds": table[list(range(10, 50))]},
                                   greedy(4, ignore_eos=True))], abort_with_other_in_flight)
    assert_idle(engine)
    assert aborted and aborted[0].outputs[0].finish_reason == "abort"
    assert outputs["other"].outputs[0].finish_reason == "length", outputs["other"].outputs[0]
    assert outputs["other"].outputs[0].token_ids == expected


# ---------------------------------------------------------------------- random workloads
def random_requests(rng: random.Random, prefix: str) -> list[tuple[Request, int]]:
    """A few requests with shared prefixes and every kind of sampling, with priorities."""
    shared = [rng.randrange(3, 250) for _ in range(rng.choice([0, 8, 13]))]
    out = []
    for i in range(rng.randrange(3, 10)):
        prompt = (shared if rng.random() < 0.5 else []) + [
            rng.randrange(3, 250) for _ in range(rng.randrange(1, 30))]
        max_tokens = rng.randrange(1, 15)
        common: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": rng.random() < 0.7}
        params = [
            SamplingParams(temperature=0.0, **common),
            SamplingParams(temperature=1.0, seed=i, **common),
            SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=1, **common),
            SamplingParams(n=rng.randrange(2, 4), temperature=0.9, seed=i, **common),
            SamplingParams(temperature=0.0, min_tokens=rng.randrange(min(3, max_tokens + 1)),
                           stop_token_ids=[rng.randrange(3, 250) for _ in range(20)],
                           **common),
            SamplingParams(temperature=0.0, repetition_penalty=1.2, **common),
        ][rng.randrange(6)]
        out.append(((f"{prefix}{i}", {"prompt_token_ids": prompt}, params),
                    rng.randrange(3)))
    return out


@pytest.mark.parametrize("seed", range(16))
def test_random_workloads_equal_the_synchronous_loop(checkpoint: Path, seed: int) -> None:
    """Random requests, engine shapes (2 to 4 microbatches, computed at submit or late,
    FCFS or priority, few blocks or many, prefix caching on or off), aborts in flight
    with the id taken again at once, and a failed microbatch now and then: what is not
    aborted or failed equals the synchronous loop's, what is keeps a prefix of it."""
    rng = random.Random(seed)
    batches, late = rng.choice([2, 3, 4]), rng.random() < 0.4
    shape = {"num_blocks": rng.choice([13, 16, 24, 64]), "max_model_len": 48,
             "max_num_batched_tokens": rng.choice([8, 16, 32]),
             "max_num_seqs": rng.choice([2, 3, 8])}
    policy = rng.choice(["fcfs", "priority"])
    caching = rng.random() < 0.8
    requests = random_requests(rng, "q")
    newcomers = random_requests(rng, "new")[:2]
    aborts = {req[0]: rng.randrange(12) for req, _ in rng.sample(requests, 2)}

    def build(num: int) -> LLMEngine:
        engine = LLMEngine(EngineConfig(
            model=ModelConfig(model=str(checkpoint), max_model_len=48),
            cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=shape["num_blocks"],
                              enable_prefix_caching=caching),
            scheduler=SchedulerConfig(max_num_seqs=shape["max_num_seqs"], policy=policy,
                                      max_num_batched_tokens=shape["max_num_batched_tokens"],
                                      max_concurrent_batches=num),
            device="cpu"))
        core = engine.engine_core
        if num > 1:
            inner = (LatePipeline(InProcessExecutor(core.runner), num, 0.0002) if late else
                     Recorder(InProcessExecutor(core.runner), num, 0.0002, core=core,
                              max_rows=shape["max_num_seqs"]))
            core.executor = FailOne(inner, lambda so: rng.random() < 0.05)
        return engine

    def submit_all(engine: LLMEngine, reqs: list[tuple[Request, int]]) -> None:
        for (req_id, prompt, params), priority in reqs:
            engine.add_request(req_id, prompt, params, priority=priority)

    reference_engine = build(1)
    submit_all(reference_engine, requests + newcomers)
    reference = run(reference_engine, [])
    engine = build(batches)
    submit_all(engine, requests)
    aborted: dict[str, RequestOutput] = {}
    taken_by: dict[str, str] = {}

    def abort_and_take_ids(engine: LLMEngine, index: int, outputs: list[RequestOutput]) -> None:
        for req_id, when in aborts.items():
            if when == index and (ended := engine.abort_request(req_id)):
                [aborted[req_id]] = ended
                if len(taken_by) < len(newcomers):
                    (name, prompt, params), priority = newcomers[len(taken_by)]
                    engine.add_request(req_id, prompt, params, priority=priority)
                    taken_by[req_id] = name

    outputs = run(engine, [], abort_and_take_ids)
    assert_idle(engine)
    failing = engine.engine_core.executor
    assert isinstance(failing, FailOne)
    failed_ids = set() if failing.failed is None else set(failing.failed.num_scheduled_tokens)

    def check(got: RequestOutput, want: RequestOutput, req_id: str, cut: bool) -> None:
        """Equal, or (`cut` short: aborted, or in the failed microbatch) a prefix."""
        if any(c.finish_reason == "error" for c in got.outputs):
            assert any(r.split("\0")[0] == req_id for r in failed_ids), req_id
            cut = True
        if not cut:
            assert_same_output(got, want, req_id, cached_tokens=False)
            return
        for got_c, want_c in zip(got.outputs, want.outputs, strict=True):
            assert got_c.token_ids == want_c.token_ids[:len(got_c.token_ids)], req_id

    for (req_id, _, _), _ in requests:
        check(aborted.get(req_id, outputs[req_id]), reference[req_id], req_id,
              req_id in aborted)
        if req_id in taken_by:
            check(outputs[req_id], reference[taken_by[req_id]], req_id, False)
