"""Structured outputs through the offline engine with a random-weight model whose free text
is never JSON: every constrained output parses and validates, under n > 1, prefix caching
and preemption; a step without a constrained request does no mask work at all."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import jsonschema
import pytest
from kvferry.engine.frontend.llm import LLM
from kvferry.engine.sample.metadata import SamplingMetadata
from kvferry.engine.sampling_params import SamplingParams, StructuredOutputsParams

# Nested objects, arrays, enums and required fields; every string and array is bounded, so
# a random model ends each object within the token budget.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "colour", "tags", "address", "active"],
    "additionalProperties": False,
}
PROMPTS = ["Hello there", "Describe a person", "x", "The river and the town", "42",
           "Tell me a story about a", "{", "JSON please:"]


@pytest.fixture(scope="module")
def llm(demo_checkpoint: Path) -> Iterator[LLM]:
    engine = LLM(str(demo_checkpoint), dtype="float32", max_model_len=512,
                 kv_cache_memory_bytes=64 << 20, max_num_seqs=32)
    yield engine
    engine.llm_engine.engine_core.shutdown()


def texts(outputs: list) -> list[tuple[str, str]]:
    return [(c.text, c.finish_reason) for o in outputs for c in o.outputs]


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_unconstrained_output_of_the_random_model_is_not_json(llm: LLM) -> None:
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=30, n=2, seed=5), use_tqdm=False)
    assert not any(is_json(text) for text, _ in texts(outputs))


def test_every_json_schema_output_parses_and_validates(llm: LLM) -> None:
    params = SamplingParams(max_tokens=300, n=2, seed=1,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outputs = llm.generate(PROMPTS * 2, params, use_tqdm=False)
    results = texts(outputs)
    assert len(results) == 32
    for text, finish_reason in results:
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        # The properties come in the schema's order, with json.dumps's separators.
        assert list(json.loads(text)) == list(SCHEMA["properties"])
        assert text == json.dumps(json.loads(text), ensure_ascii=False)
    # Seeded: a prompt's second copy repeats the first whatever it was batched with, and the
    # two completions of a prompt (seeds 1 and 2) differ.
    assert results[:16] == results[16:]
    assert len({text for text, _ in results}) == 16


def test_regex_choice_and_grammar_outputs_always_match(llm: LLM) -> None:
    regex = r"[0-9]{3}-[a-z]{2,5}( [A-Z][a-z]{0,6})?"
    choices = ["yes", "no", "maybe so", 'a "quoted"\nanswer']
    cases = [
        (StructuredOutputsParams(regex=regex), lambda t: re.fullmatch(regex, t) is not None),
        (StructuredOutputsParams(choice=choices), lambda t: t in choices),
        (StructuredOutputsParams(grammar='root ::= "(" ("ab" | "c")* ")"'),
         lambda t: re.fullmatch(r"\((ab|c)*\)", t) is not None),
    ]
    for spec, matches in cases:
        params = SamplingParams(max_tokens=40, n=2, seed=2, structured_outputs=spec)
        results = texts(llm.generate(PROMPTS, params, use_tqdm=False))
        assert all(matches(text) and reason == "stop" for text, reason in results), results


def test_a_grammar_ends_the_request_even_when_eos_is_ignored(llm: LLM) -> None:
    params = SamplingParams(max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["done"]))
    [output] = llm.generate(["Go"], params, use_tqdm=False)
    assert output.outputs[0].text == "done" and output.outputs[0].finish_reason == "stop"


def test_a_constraint_that_does_not_compile_is_refused_before_anything_runs(llm: LLM) -> None:
    good = SamplingParams(max_tokens=5)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b"))
    with pytest.raises(ValueError, match="(?s)^the regex cannot be compiled: .*unclosed group"):
        llm.generate(["a", "b"], [good, bad], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(llm: LLM) -> None:
    engine = llm.llm_engine
    spec = StructuredOutputsParams(json={**SCHEMA, "title": "aborted while compiling"})
    engine.add_request("compiling", "Hi", SamplingParams(structured_outputs=spec))
    assert [r.request_id for r in engine.scheduler.waiting_for_grammar] == ["compiling"]
    engine.abort_request("compiling")
    assert engine.scheduler.waiting_for_grammar == []
    assert engine.engine_core.structured_output.num_requests == 0
    assert not engine.has_unfinished_requests()


class SamplerSpy:
    """Records, per sampler call, the number of rows and of rows under a grammar."""

    def __init__(self, llm: LLM) -> None:
        self.sampler = llm.llm_engine.runner.sampler
        self.forward = self.sampler.forward
        self.calls: list[tuple[int, int | None]] = []

    def __enter__(self) -> Self:
        def record(logits, metadata: SamplingMetadata):
            bitmask = metadata.grammar_bitmask
            self.calls.append((metadata.num_rows, None if bitmask is None else bitmask.shape[0]))
            return self.forward(logits, metadata)

        self.sampler.forward = record
        return self

    def __exit__(self, *exc: object) -> None:
        del self.sampler.forward


def test_steps_without_a_constrained_request_do_no_mask_work(llm: LLM) -> None:
    manager = llm.llm_engine.engine_core.structured_output
    before = (manager.num_bitmasks, manager.num_bitmask_rows)
    with SamplerSpy(llm) as spy:
        llm.generate(PROMPTS, SamplingParams(max_tokens=20, n=2), use_tqdm=False)
    assert (manager.num_bitmasks, manager.num_bitmask_rows) == before
    assert spy.calls and all(masked is None for _, masked in spy.calls)


def test_mask_rows_go_to_constrained_samples_only(llm: LLM) -> None:
    manager = llm.llm_engine.engine_core.structured_output
    before = (manager.num_bitmasks, manager.num_bitmask_rows)
    constrained = SamplingParams(max_tokens=300, seed=3,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    free = SamplingParams(max_tokens=120, ignore_eos=True)
    with SamplerSpy(llm) as spy:
        outputs = llm.generate(["Hi", "Hello", "Hey"], [constrained, free, constrained],
                               use_tqdm=False)
    num_constrained_tokens = len(outputs[0].outputs[0].token_ids) + len(
        outputs[2].outputs[0].token_ids)
    masked_calls = [(rows, masked) for rows, masked in spy.calls if masked is not None]
    # One mask row per constrained token, a bitmask per step that sampled one, none else.
    assert manager.num_bitmask_rows - before[1] == num_constrained_tokens
    assert manager.num_bitmasks - before[0] == len(masked_calls)
    assert sum(masked for _, masked in masked_calls) == num_constrained_tokens
    # The free request outlives both: its last steps ran the unconstrained path.
    assert spy.calls[-1][1] is None and len(outputs[1].outputs[0].token_ids) == 120


def test_constrained_requests_survive_preemption(demo_checkpoint: Path) -> None:
    # 11 blocks of 16 tokens: three requests growing to ~80 tokens each cannot all fit.
    llm = LLM(str(demo_checkpoint), dtype="float32", max_model_len=160,
              num_gpu_blocks_override=12, max_num_seqs=3)
    params = SamplingParams(max_tokens=140, seed=4,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for text, finish_reason in texts(outputs):
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    llm.llm_engine.engine_core.shutdown()


def test_an_unconstrained_engine_never_loads_the_grammar_engine(demo_checkpoint: Path) -> None:
    script = (
        "import sys\n"
        "from kvferry.engine.frontend.llm import LLM\n"
        "from kvferry.engine.sampling_params import SamplingParams\n"
        f"llm = LLM({str(demo_checkpoint)!r}, max_model_len=128, kv_cache_memory_bytes=1 << 24)\n"
        "llm.generate(['Hi', 'Ho'], SamplingParams(max_tokens=4), use_tqdm=False)\n"
        "print('llguidance' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=True)
    assert done.stdout.strip() == "False", done.stderr
