"""The router's table of request field types (`kvferry.protocol.request_checks`) and the
engine's pydantic models refuse exactly the same values, with the same `param`: every field
of the table, probed with a value of every JSON type."""

from __future__ import annotations

from typing import Any

import pytest
from kvferry_testing.request_answers import MODELS, engine_answer, router_answer

from kvferry.protocol.request_checks import FIELDS

VALID = {"/v1/completions": {"prompt": "w5"},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "w5"}]}}
# A value of each JSON type, in ranges every field of that type takes.
PROBES: list[Any] = [None, True, False, 1, 0, 2**63, 1.0, 0.5, "1", "x", [], [1], [True],
                     ["x"], [[1]], [[True]], [1.0], {}, {"include_usage": True}]
# Fields whose items the engine's models check further (nested models): the router only
# checks that they are lists or objects, and relays the rest to the pods.
NESTED = frozenset({"messages", "stream_options", "chat_template_kwargs", "logit_bias",
                    "response_format", "structured_outputs", "tools"})


CASES = [(endpoint, name, probe) for endpoint in FIELDS for name in FIELDS[endpoint]
         for probe in PROBES]


@pytest.mark.parametrize(("endpoint", "name", "probe"), CASES,
                         ids=[f"{e.split('/')[-1]}-{n}-{p!r}" for e, n, p in CASES])
def test_router_and_engine_refuse_the_same_values(endpoint: str, name: str, probe: Any) -> None:
    body = {**VALID[endpoint], name: probe}
    engine, router = engine_answer(endpoint, body), router_answer(endpoint, body)
    if name in NESTED and router is None:
        return  # the pod judges the items; the router relays its answer
    assert router == engine


def test_every_field_of_the_models_is_in_the_table() -> None:
    for endpoint, model in MODELS.items():
        expected = set(model.model_fields) - {"kv_transfer_params"}
        assert set(FIELDS[endpoint]) == expected, endpoint
