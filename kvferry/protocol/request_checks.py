"""What the router and the engine pods both refuse in a generation request body, before any
work is done for it: text that is not valid Unicode, and fields of the wrong JSON type.

The engine pods check bodies with their pydantic models (strict types); the router checks
the same fields with the table below, without the engine, so that a body one of them
refuses the other refuses too, with the same status (400) and `param`. Values (ranges,
limits, the model name) are the engine's to judge: the router relays those to a pod.

JSON types, as the OpenAI API takes them: integers are integers (not `true`, not `5.0`,
not `"5"`); numbers are integers or floats (not booleans, not strings); booleans are
`true`/`false`; token ids are integers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from kvferry.protocol.errors import InvalidRequest
from kvferry.protocol.request_fields import check_refused

__all__ = ["InvalidRequest", "check_body", "check_prompt_inputs", "check_types", "check_unicode",
           "known_fields"]

# Integers cross to the engine core as msgpack, which holds 64 bits.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

# Python decodes a JSON surrogate pair into one character, so any surrogate left is lone.
_SURROGATE = re.compile("[\ud800-\udfff]")


# ---- text ------------------------------------------------------------------------------


def find_lone_surrogate(value: Any, path: str) -> tuple[str, int, str] | None:
    """(location, character index, surrogate) of the first lone surrogate in a JSON value."""
    if isinstance(value, str):
        if value.isascii():
            return None
        match = _SURROGATE.search(value)
        return None if match is None else (path, match.start(), match.group())
    if isinstance(value, dict):
        for key, item in value.items():
            key_path = f"{path}.{key}" if path else str(key)
            found = find_lone_surrogate(key, f"{key_path} (its name)")
            if found is None:
                found = find_lone_surrogate(item, key_path)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = find_lone_surrogate(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def check_unicode(body: Any) -> None:
    """InvalidRequest when the body holds a lone UTF-16 surrogate.

    JSON can spell one (`"\\ud800"`) and Python keeps it in a str, but no UTF-8 tokenizer or
    codec accepts it: found before anything reads the text, it is a 400 naming its field
    instead of a failure deep in a tokenizer.
    """
    found = find_lone_surrogate(body, "")
    if found is not None:
        path, position, char = found
        raise InvalidRequest(
            f"{path} holds a lone UTF-16 surrogate (\\u{ord(char):04x}) at character "
            f"{position}: text must be valid Unicode (a surrogate only comes in a "
            "high-low pair)", param=field_of(path))


def field_of(path: str) -> str:
    """The top-level field of a location: "messages[0].content" -> "messages"."""
    for end, char in enumerate(path):
        if char in ".[ ":
            return path[:end]
    return path


# ---- types -----------------------------------------------------------------------------

# A type check: None when `value` has the type, else what it should be (pydantic's words,
# so the router's messages read like the pods'), after "[index]: " when one item of a list
# is wrong.
TypeCheck = Callable[[Any], str | None]


def _is_int(value: Any) -> bool:
    return type(value) is int and INT64_MIN <= value <= INT64_MAX


def _int(value: Any) -> str | None:
    if type(value) is not int:  # bool is a subclass of int: `true` is not a number
        return "Input should be a valid integer"
    if not INT64_MIN <= value <= INT64_MAX:
        return f"Input should be between {INT64_MIN} and {INT64_MAX}"
    return None


def _number(value: Any) -> str | None:
    if type(value) is int:
        return None
    if type(value) is not float:
        return "Input should be a valid number"
    if not math.isfinite(value):  # Python's JSON parser reads NaN and Infinity
        return "Input should be a finite number"
    return None


def _bool(value: Any) -> str | None:
    return None if type(value) is bool else "Input should be a valid boolean"


def _str(value: Any) -> str | None:
    return None if type(value) is str else "Input should be a valid string"


def _object(value: Any) -> str | None:
    return None if type(value) is dict else "Input should be a valid dictionary"


def _list(value: Any) -> str | None:
    return None if type(value) is list else "Input should be a valid list"


def _str_or_strs(value: Any) -> str | None:
    if type(value) is str or (type(value) is list and all(type(v) is str for v in value)):
        return None
    return "Input should be a string or a list of strings"


def _strs(value: Any) -> str | None:
    if type(value) is not list:
        return "Input should be a valid list"
    for index, item in enumerate(value):
        if type(item) is not str:
            return f"[{index}]: Input should be a valid string"
    return None


def _str_or_object(value: Any) -> str | None:
    if type(value) is str or type(value) is dict:
        return None
    return "Input should be a string or an object"


def _token_ids(value: Any) -> str | None:
    if type(value) is not list:
        return "Input should be a valid list"
    for index, item in enumerate(value):
        problem = _int(item)
        if problem is not None:
            # The item's location first, as the engine's validation errors name it.
            return f"[{index}]: {problem}"
    return None


def _prompt(value: Any) -> str | None:
    if type(value) is str:
        return None
    if type(value) is list and (
            all(type(v) is str for v in value) or all(_is_int(v) for v in value)
            or all(type(v) is list and all(_is_int(t) for t in v) for v in value)):
        return None
    return ("Input should be a string, a list of strings, a list of token ids (64-bit "
            "integers) or a list of lists of token ids")


def _nullable(check: TypeCheck) -> TypeCheck:
    def check_nullable(value: Any) -> str | None:
        return None if value is None else check(value)

    return check_nullable


# The fields both generation endpoints take. A field missing from a table is not checked
# here (the engine judges it); `null` is accepted exactly where the engine's model takes it.
_SAMPLING_FIELDS: dict[str, TypeCheck] = {
    "model": _nullable(_str),
    "n": _int,
    "temperature": _nullable(_number),
    "top_p": _nullable(_number),
    "top_k": _nullable(_int),
    "min_p": _nullable(_number),
    "seed": _nullable(_int),
    "stop": _nullable(_str_or_strs),
    "stop_token_ids": _nullable(_token_ids),
    "presence_penalty": _number,
    "frequency_penalty": _number,
    "repetition_penalty": _number,
    "ignore_eos": _bool,
    "min_tokens": _int,
    "skip_special_tokens": _bool,
    "include_stop_str_in_output": _bool,
    "stream": _bool,
    "stream_options": _nullable(_object),
    "priority": _int,
    "user": _nullable(_str),
    # Structured outputs: OpenAI's, vLLM's and vLLM's older spellings.
    "response_format": _nullable(_object),
    "structured_outputs": _nullable(_object),
    "guided_json": _nullable(_str_or_object),
    "guided_regex": _nullable(_str),
    "guided_choice": _nullable(_strs),
    "guided_grammar": _nullable(_str),
    "guided_decoding_backend": _nullable(_str),
    "logit_bias": _nullable(_object),
    "allowed_token_ids": _nullable(_token_ids),
}

COMPLETION_FIELDS: Mapping[str, TypeCheck] = {
    **_SAMPLING_FIELDS,
    "prompt": _nullable(_prompt),
    "prompt_embeds": _nullable(_str_or_strs),
    "max_tokens": _nullable(_int),
    "logprobs": _nullable(_int),
    "echo": _bool,
    "prompt_logprobs": _nullable(_int),
    "add_special_tokens": _bool,
}

CHAT_FIELDS: Mapping[str, TypeCheck] = {
    **_SAMPLING_FIELDS,
    "messages": _list,
    "max_tokens": _nullable(_int),
    "max_completion_tokens": _nullable(_int),
    "logprobs": _bool,
    "top_logprobs": _nullable(_int),
    "add_generation_prompt": _bool,
    "chat_template_kwargs": _nullable(_object),
    "tools": _nullable(_list),
    "tool_choice": _nullable(_str_or_object),
    "parallel_tool_calls": _nullable(_bool),
}

# Fields a body must have, unless it has the alternative (`check_prompt_inputs`).
REQUIRED_FIELDS: Mapping[str, str] = {"/v1/completions": "prompt",
                                      "/v1/chat/completions": "messages"}
_ALTERNATIVES: Mapping[str, str] = {"prompt": "prompt_embeds"}
FIELDS: Mapping[str, Mapping[str, TypeCheck]] = {"/v1/completions": COMPLETION_FIELDS,
                                                 "/v1/chat/completions": CHAT_FIELDS}


def check_types(endpoint: str, body: dict[str, Any]) -> None:
    """InvalidRequest naming the first field of `endpoint` that `body` lacks (when required)
    or holds with a JSON type the endpoint does not take.

    Fields are visited in the order the engine's models declare them (the tables' order), so
    a body with several wrong fields gets the same `param` from the router as from a pod.
    """
    required = REQUIRED_FIELDS[endpoint]
    for name, check in FIELDS[endpoint].items():
        if name not in body:
            alternative = _ALTERNATIVES.get(name)
            if name == required and alternative not in body:
                either = f" (or {alternative})" if alternative else ""
                raise InvalidRequest(f"{name}: Field required{either}", param=name)
            continue
        problem = check(body[name])
        if problem is None:
            continue
        if problem.startswith("["):  # an item of a list: "[3]: Input should be ..."
            where, _, problem = problem.partition(": ")
            raise InvalidRequest(f"{name}{where}: {problem}", param=name + where)
        raise InvalidRequest(f"{name}: {problem}", param=name)


def check_prompt_inputs(prompt: Any, prompt_embeds: Any) -> None:
    """InvalidRequest unless a /v1/completions body gives exactly one of `prompt` and
    `prompt_embeds` (null is not given): checked after the types, by the pods and the router
    alike. Beside prompt_embeds an empty prompt ("" or []) counts as none: the official
    client must send a prompt, and vLLM's examples send "" with embeddings."""
    if prompt_embeds is None:
        if prompt is None:
            raise InvalidRequest("prompt: Field required (or prompt_embeds)", param="prompt")
        return
    if prompt is not None and prompt != "" and prompt != []:
        raise InvalidRequest("prompt_embeds: give either prompt or prompt_embeds, not both",
                             param="prompt_embeds")


def check_body(endpoint: str, body: dict[str, Any]) -> None:
    """Everything the engine checks before its models read a field, in its order: text
    first, then fields it refuses (`request_fields`), then types."""
    check_unicode(body)
    check_refused(endpoint, body)
    check_types(endpoint, body)


def known_fields(endpoint: str) -> frozenset[str]:
    """The fields of `endpoint` the servers honour (the table, and the transfer params)."""
    return frozenset(FIELDS[endpoint]) | {"kv_transfer_params"}
