import json
import re

import pytest
from pydantic import BaseModel

from kvferry.engine.sampling_params import SamplingParams, StructuredOutputsParams


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert params.n == 1
    assert params.presence_penalty == 0.0
    assert params.frequency_penalty == 0.0
    assert params.repetition_penalty == 1.0
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.min_p == 0.0
    assert params.seed is None
    assert params.stop == []
    assert params.stop_token_ids == []
    assert params.ignore_eos is False
    assert params.max_tokens == 16
    assert params.min_tokens == 0
    assert params.logprobs is None
    assert params.skip_special_tokens is True
    assert params.include_stop_str_in_output is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_k": -2}, "top_k must be -1 (disabled) or >= 0, got -2"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"presence_penalty": -2.5}, "presence_penalty must be in [-2, 2], got -2.5"),
        ({"frequency_penalty": 3.0}, "frequency_penalty must be in [-2, 2], got 3.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 20}, "min_tokens must be <= max_tokens (16), got 20"),
        ({"logprobs": -1}, "logprobs must be in [0, 20], got -1"),
        ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
        ({"stop": ["ok", ""]}, "stop[1] must be a non-empty string, got ''"),
        ({"stop": ""}, "stop[0] must be a non-empty string, got ''"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids[1] must be >= 0, got -1"),
    ],
)
def test_validation_names_field_value_and_limit(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1},
        {"top_k": 0},
        {"top_p": 1.0},
        {"min_p": 1.0},
        {"temperature": 0.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"max_tokens": None, "min_tokens": 1000},
        {"min_tokens": 16},
        {"logprobs": 0},
        {"logprobs": 20},
    ],
)
def test_limits_are_inclusive_where_documented(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_stop_is_normalized_to_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(7, 9)).stop_token_ids == [7, 9]


def test_is_greedy_below_epsilon() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert not SamplingParams().is_greedy


def test_clone_for_child_offsets_seed_and_sets_n_to_one() -> None:
    parent = SamplingParams(n=3, seed=100, stop=["x"], temperature=0.7)
    children = [parent.clone_for_child(i) for i in range(3)]
    assert [c.seed for c in children] == [100, 101, 102]
    assert all(c.n == 1 and c.temperature == 0.7 and c.stop == ["x"] for c in children)
    children[0].stop.append("y")
    assert parent.stop == ["x"]
    assert parent.n == 3


def test_clone_for_child_without_seed_keeps_none() -> None:
    child = SamplingParams(n=2).clone_for_child(1)
    assert child.seed is None
    assert child.n == 1


# ---- structured outputs ---------------------------------------------------------------

EXACTLY_ONE = ("structured_outputs must set exactly one of json, json_object, regex, choice "
               "and grammar, got ")


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({}, ValueError, EXACTLY_ONE + "none"),
    ({"regex": "a", "choice": ["a"]}, ValueError, EXACTLY_ONE + "regex, choice"),
    ({"json": {"type": "object"}, "json_object": True}, ValueError,
     EXACTLY_ONE + "json, json_object"),
    ({"choice": []}, ValueError, "structured_outputs.choice must hold at least one string"),
    ({"choice": ["a", 1]}, TypeError, "structured_outputs.choice[1] must be a string, got int"),
    ({"regex": ""}, ValueError, "structured_outputs.regex must be a non-empty string"),
    ({"grammar": 5}, ValueError, "structured_outputs.grammar must be a non-empty string"),
    ({"json": "{not json"}, ValueError, ("structured_outputs.json is not valid JSON: Expecting "
                                         "property name enclosed in double quotes: line 1 "
                                         "column 2 (char 1)")),
    ({"json": [1]}, TypeError,
     "structured_outputs.json must be a JSON schema (an object), got list"),
])
def test_structured_outputs_take_exactly_one_valid_constraint(
        kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        StructuredOutputsParams(**kwargs)


def test_a_schema_is_kept_as_compact_json_in_its_own_key_order() -> None:
    class Point(BaseModel):
        y: int
        x: int

    as_dict = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    as_text = StructuredOutputsParams(json='{"type": "object",  "properties": {"b": {}, "a": {}}}')
    assert as_dict.json == as_text.json == '{"type":"object","properties":{"b":{},"a":{}}}'
    assert as_dict.key == as_text.key == ("json", as_dict.json, True)
    model = StructuredOutputsParams(json=Point)
    assert list(json.loads(model.json)["properties"]) == ["y", "x"]
    assert StructuredOutputsParams(choice=("a", "b")).key == ("choice", '["a", "b"]', True)
    assert StructuredOutputsParams(json_object=True, strict=False).key == ("json_object", "", False)


def test_structured_outputs_travel_with_the_params_to_every_child() -> None:
    spec = StructuredOutputsParams(regex="[0-9]+")
    params = SamplingParams(n=3, structured_outputs=spec)
    assert all(params.clone_for_child(i).structured_outputs is spec for i in range(3))
    with pytest.raises(TypeError, match="^structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
