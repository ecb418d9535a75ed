"""Structured outputs from a request's fields: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_json`, `guided_regex`, `guided_choice` and
`guided_grammar`, turned into the one `StructuredOutputsParams` the engine enforces.

A request constrains its output with at most one of them (a second is a 400 naming both);
the constraint is compiled before the request runs, so one that does not compile is a 400
naming the field that gave it, streamed or not.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvferry.engine.frontend.async_llm import AsyncLLM
from kvferry.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvferry.engine.server.errors import bad_request
from kvferry.engine.server.protocol import ResponseFormat, SamplingRequest, StructuredOutputsRequest

# `guided_decoding_backend` values that name the engine kvferry runs (llguidance, which
# vLLM calls "guidance"); asking for another one is refused rather than ignored.
GRAMMAR_BACKENDS = frozenset({"auto", "guidance", "llguidance"})


@dataclass(frozen=True)
class Constraint:
    """A request's constraint and the field that set it (the `param` of its errors)."""

    params: StructuredOutputsParams
    param: str


def constraint_of(body: SamplingRequest) -> Constraint | None:
    """The constraint the body's structured-output fields ask for; a 400 naming the field
    when one is malformed or two are given."""
    _check_backend(body.guided_decoding_backend)
    found = [c for c in (_from_response_format(body.response_format),
                         _from_structured_outputs(body.structured_outputs),
                         *_from_guided_fields(body)) if c is not None]
    if len(found) > 1:
        names = " and ".join(c.param for c in found)
        raise bad_request(f"{names} each constrain the output; give one of them",
                          param=found[1].param)
    return found[0] if found else None


def _check_backend(backend: str | None) -> None:
    if backend is not None and backend not in GRAMMAR_BACKENDS:
        raise bad_request(
            f"guided_decoding_backend {backend!r} is not available: this server's grammar "
            "engine is llguidance ('guidance'); send 'auto', 'guidance' or leave it out",
            param="guided_decoding_backend")


def _from_response_format(response_format: ResponseFormat | None) -> Constraint | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return _make("response_format", json_object=True)
    if response_format.type == "json_schema":
        json_schema = response_format.json_schema
        if json_schema is None or json_schema.json_schema is None:
            raise bad_request("response_format of type 'json_schema' needs "
                              "json_schema.schema", param="response_format.json_schema")
        return _make("response_format", json=json_schema.json_schema,
                     strict=json_schema.strict is not False)
    raise bad_request(f"response_format.type {response_format.type!r} is not supported: use "
                      "'text', 'json_object' or 'json_schema'", param="response_format.type")


def _from_structured_outputs(request: StructuredOutputsRequest | None) -> Constraint | None:
    if request is None:
        return None
    return _make("structured_outputs", json=request.json_schema, regex=request.regex,
                 choice=request.choice, grammar=request.grammar,
                 json_object=bool(request.json_object))


def _from_guided_fields(body: SamplingRequest) -> list[Constraint | None]:
    return [
        None if body.guided_json is None else _make("guided_json", json=body.guided_json),
        None if body.guided_regex is None else _make("guided_regex", regex=body.guided_regex),
        None if body.guided_choice is None else _make("guided_choice", choice=body.guided_choice),
        None if body.guided_grammar is None else _make("guided_grammar",
                                                       grammar=body.guided_grammar),
    ]


def _make(param: str, **fields: object) -> Constraint:
    try:
        return Constraint(StructuredOutputsParams(**fields), param)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        message = str(exc)
        if param != "structured_outputs":
            # The params name their own fields ("structured_outputs.choice[1] must ..."):
            # name the request's field instead ("guided_choice[1] must ...").
            for name in fields:
                message = message.replace(f"structured_outputs.{name}", param)
        raise bad_request(message, param=param) from None


async def check_constraint(engine: AsyncLLM, params: SamplingParams, param: str | None) -> None:
    """A 400 naming `param` when the params' constraint does not compile for this model.

    Compiling runs on a worker thread (the first constraint also builds the grammar
    engine's view of the tokenizer, a second for a large vocabulary); the result is cached
    per distinct constraint, so the engine's own check of the request is then free.
    """
    if params.structured_outputs is None:
        return
    try:
        await asyncio.to_thread(engine.input_processor.check_structured_outputs, params)
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None
