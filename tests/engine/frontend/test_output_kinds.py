"""The core sends only what each step added; the front end hands out cumulative, delta or
final outputs built from it, and they agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.engine.config import CacheConfig, EngineConfig, ModelConfig
from kvferry.engine.frontend.llm_engine import LLMEngine, RequestOutputKind
from kvferry.engine.frontend.outputs import RequestOutput
from kvferry.engine.sampling_params import SamplingParams

PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture(scope="module")
def engine(make_checkpoint) -> LLMEngine:
    path: Path = make_checkpoint("LlamaForCausalLM")
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), max_model_len=64),
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=64),
        device="cpu",
    ))


def _params(**extra: object) -> SamplingParams:
    return SamplingParams(
        n=2, temperature=1.0, seed=7, max_tokens=9, ignore_eos=True, logprobs=2,
        **extra,  # type: ignore[arg-type]
    )


def _outputs(engine: LLMEngine, kind: RequestOutputKind, **extra: object) -> list[RequestOutput]:
    engine.add_request("r", PROMPT, _params(**extra), output_kind=kind)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_core_outputs_carry_only_the_new_tokens(engine: LLMEngine) -> None:
    core = engine.engine_core
    engine.add_request("r", PROMPT, _params())
    new_counts = []
    while core.has_unfinished_requests():
        step = core.step()
        new_counts += [len(o.new_token_ids) for o in step.outputs]
        assert all(len(o.new_logprobs or []) == len(o.new_token_ids) for o in step.outputs)
        engine.output_processor.process_outputs(step.outputs, engine.stats.last_iteration)
    assert new_counts == [1] * 18  # two completions of nine tokens, one token per step each


def test_delta_outputs_add_up_to_the_final_output(engine: LLMEngine) -> None:
    (final,) = _outputs(engine, RequestOutputKind.FINAL_ONLY)
    deltas = _outputs(engine, RequestOutputKind.DELTA)
    cumulative = _outputs(engine, RequestOutputKind.CUMULATIVE)
    assert final.finished and deltas[-1].finished and cumulative[-1].finished
    assert len(deltas) == len(cumulative) == 9
    for index in (0, 1):
        expected = final.outputs[index]
        pieces = [c for out in deltas for c in out.outputs if c.index == index]
        assert all(len(c.token_ids) == 1 for c in pieces)
        assert [t for c in pieces for t in c.token_ids] == expected.token_ids
        assert "".join(c.text for c in pieces) == expected.text
        assert [p for c in pieces for p in c.logprobs] == expected.logprobs
        # The finish reason is handed out exactly once, with the last delta.
        assert [c.finish_reason for c in pieces] == [None] * 8 + ["length"]
        assert cumulative[-1].outputs[index].token_ids == expected.token_ids
        assert cumulative[-1].outputs[index].text == expected.text


def test_delta_text_holds_back_a_possible_stop_string(engine: LLMEngine) -> None:
    (final,) = _outputs(engine, RequestOutputKind.FINAL_ONLY)
    text = final.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    (stopped,) = _outputs(engine, RequestOutputKind.FINAL_ONLY, stop=[stop])
    deltas = _outputs(engine, RequestOutputKind.DELTA, stop=[stop])
    pieces = [c.text for out in deltas for c in out.outputs if c.index == 0]
    assert "".join(pieces) == stopped.outputs[0].text
    assert stop not in "".join(pieces)
