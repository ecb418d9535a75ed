"""What the servers do with the request fields of OpenAI's and vLLM's schemas that they do
not honour, and with fields neither schema has.

Every field a client may send to /v1/completions or /v1/chat/completions is one of:

- honoured: a field of the engine's request models (and of the router's type table,
  `request_checks.FIELDS`);
- accepted, changing nothing: `IGNORED` (bookkeeping fields of OpenAI's, such as `user`
  or `store`, that say nothing about the output);
- refused: `REFUSED`, a 400 that names the field and says why, unless its value is one
  that changes nothing (`false`, `null`, an empty list, the default): clients that send
  every field with its default value keep working;
- unknown: neither schema has it. It is not refused (clients send fields of API versions
  newer than the server's), but each server logs its name once and counts it
  (`UnknownFields`), so a field that is silently dropped is at least visible.

The router and the engine pods apply the same table, so a refused field costs no hop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvferry.protocol.errors import InvalidRequest

logger = logging.getLogger("kvferry.protocol.request_fields")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# Fields of OpenAI's schemas that say nothing about the output: accepted and ignored.
IGNORED = frozenset({"metadata", "store", "service_tier", "prompt_cache_key",
                     "safety_identifier"})

# value, whole body -> True when the value asks for nothing (the field may be sent).
Inert = Callable[[Any, Mapping[str, Any]], bool]


def _null(value: Any, _body: Mapping[str, Any]) -> bool:
    return value is None


def _off(value: Any, _body: Mapping[str, Any]) -> bool:
    return value is None or value is False


def _empty(value: Any, _body: Mapping[str, Any]) -> bool:
    return value is None or (type(value) in (list, dict, str) and len(value) == 0)


def _default(default: Any) -> Inert:
    def is_default(value: Any, _body: Mapping[str, Any]) -> bool:
        return value is None or (type(value) is type(default) and value == default)

    return is_default


def _best_of_is_n(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or (type(value) is int and value == body.get("n", 1))


@dataclass(frozen=True)
class Refused:
    """A field the servers refuse unless `inert` says its value asks for nothing."""

    why: str
    inert: Inert


_COMMON: dict[str, Refused] = {
    "use_beam_search": Refused("beam search is not supported", _off),
    "length_penalty": Refused("length_penalty scores beam search, which is not supported",
                              _default(1.0)),
    "bad_words": Refused("bad_words is not supported: ban single tokens with logit_bias "
                         "of -100 instead", _empty),
    "truncate_prompt_tokens": Refused("prompt truncation is not supported: send a prompt "
                                      "that fits the model's length", _null),
    "spaces_between_special_tokens": Refused("only the default (true) is supported",
                                             _default(True)),
    "return_tokens_as_token_ids": Refused("token-id strings in logprobs are not supported",
                                          _off),
    "return_token_ids": Refused("returning token ids is not supported", _off),
    "logits_processors": Refused("custom logits processors are not supported", _empty),
    "vllm_xargs": Refused("vllm_xargs are not supported", _empty),
    "cache_salt": Refused("cache_salt is not supported: every request of a model shares "
                          "its prefix cache", _null),
    "request_id": Refused("a request id in the body is not supported: send it as the "
                          "X-Request-Id header", _null),
    "structural_tag": Refused("structural tags are not supported", _null),
    "best_of": Refused("best_of is not supported: ask for n completions (best_of may only "
                       "equal n)", _best_of_is_n),
    "guided_whitespace_pattern": Refused("a whitespace pattern is not supported: generated "
                                         "JSON has json.dumps's separators and no other "
                                         "whitespace", _null),
}

REFUSED: Mapping[str, Mapping[str, Refused]] = {
    COMPLETIONS: {
        **_COMMON,
        "suffix": Refused("suffix (text after the completion) is not supported by these "
                          "models: they have no fill-in-the-middle training", _empty),
    },
    CHAT: {
        **_COMMON,
        "audio": Refused("audio output is not supported", _null),
        "modalities": Refused("only text output is supported (modalities: [\"text\"])",
                              lambda v, _b: v is None or v == ["text"]),
        "prediction": Refused("predicted outputs are not supported", _null),
        "reasoning_effort": Refused("these models have no reasoning effort to set", _null),
        "verbosity": Refused("these models have no verbosity to set", _null),
        "web_search_options": Refused("web search is not supported", _null),
        "functions": Refused("functions is deprecated and not supported: use tools", _empty),
        "function_call": Refused("function_call is deprecated and not supported: use "
                                 "tool_choice", _null),
        "continue_final_message": Refused("continuing the final message is not supported",
                                          _off),
        "echo": Refused("echo is not supported in chat completions", _off),
        "add_special_tokens": Refused("adding special tokens to a chat prompt is not "
                                      "supported: the chat template places them", _off),
        "mm_processor_kwargs": Refused("multimodal inputs are not supported", _empty),
        "documents": Refused("documents for the chat template are not supported", _empty),
        "chat_template": Refused("a chat template per request is not supported: the "
                                 "server's template is used", _null),
        "prompt_logprobs": Refused("prompt_logprobs is served by /v1/completions only",
                                   _null),
    },
}


def check_refused(endpoint: str, body: Mapping[str, Any]) -> None:
    """InvalidRequest naming the first field of `body` that `endpoint` refuses with the
    value it has (fields in the body's order)."""
    refused = REFUSED[endpoint]
    for name, value in body.items():
        rule = refused.get(name)
        if rule is not None and not rule.inert(value, body):
            raise InvalidRequest(f"{name}: {rule.why}", param=name)


def unknown_names(endpoint: str, names: Any, known: frozenset[str] | set[str]) -> list[str]:
    """The names among `names` that are neither `known` (the server's honoured fields) nor
    in this module's tables."""
    refused = REFUSED[endpoint]
    return [name for name in names
            if name not in known and name not in IGNORED and name not in refused]


class UnknownFields:
    """Logs each request field name no schema has the first time it comes (up to
    `max_names` names, so a client cannot grow the log or the memory without bound); the
    servers count them in their metrics."""

    def __init__(self, where: str, max_names: int = 256) -> None:
        self.where = where
        self.max_names = max_names
        self._logged: set[str] = set()

    def record(self, endpoint: str, names: list[str]) -> None:
        for name in names:
            if name in self._logged or len(self._logged) >= self.max_names:
                continue
            self._logged.add(name)
            logger.warning("%s: %s request field %r is not one this server knows; it is "
                           "ignored (logged once per name)", self.where, endpoint, name[:80])
