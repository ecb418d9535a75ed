"""Per-request sampling parameters, with vLLM's names and defaults.

A `SamplingParams` is validated once, when it is built (from an OpenAI request or by a
user of the offline API), so that the sampler and the detokenizer can trust every field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

# Temperatures below this are treated as greedy decoding (argmax), as vLLM does.
GREEDY_TEMPERATURE_EPS = 1e-5
# The most alternatives a request may ask for per sampled token.
MAX_NUM_LOGPROBS = 20
# Presence and frequency penalties are limited to OpenAI's range.
MAX_ABS_PENALTY = 2.0
# A logit bias is OpenAI's: -100 (never) to 100 (always), on at most this many tokens.
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output text (vLLM's name and fields): exactly one of
    `json`, `json_object`, `regex`, `choice` and `grammar`.

    Tokens the constraint rules out are never sampled (engine/structured_output). A JSON
    schema given as a dict (or a pydantic model class) is kept as compact JSON text, so
    equal schemas share one compiled grammar.
    """

    # A JSON schema the output must validate against (a dict, JSON text or pydantic model).
    json: str | dict[str, Any] | None = None
    # The output must match this regular expression (Rust `regex` syntax) in full.
    regex: str | None = None
    # The output must be exactly one of these strings.
    choice: list[str] | None = None
    # A context-free grammar: Lark syntax, or GBNF (llama.cpp's, with `::=` rules).
    grammar: str | None = None
    # The output must be one JSON object (any keys and values).
    json_object: bool = False
    # For JSON schemas: a keyword the grammar engine cannot enforce is an error (True), or
    # is ignored (False: OpenAI's `strict: false`, a best effort).
    strict: bool = True

    def __post_init__(self) -> None:
        self.json = _schema_text(self.json)
        if self.choice is not None:
            self.choice = list(self.choice)
        kinds = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice "
                f"and grammar, got {', '.join(kinds) if kinds else 'none'}")
        self._validate_values()

    def _validate_values(self) -> None:
        if self.choice is not None:
            if not self.choice:
                raise ValueError("structured_outputs.choice must hold at least one string")
            for index, item in enumerate(self.choice):
                if not isinstance(item, str):
                    raise TypeError(f"structured_outputs.choice[{index}] must be a string, "
                                    f"got {type(item).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: (kind, text of the constraint, strict)."""
        kind = self.kind
        if kind == "json_object":
            text = ""
        elif kind == "choice":
            text = json.dumps(self.choice, ensure_ascii=False)
        else:
            text = getattr(self, kind)
        return kind, text, self.strict


def _schema_text(schema: Any) -> str | None:
    """A JSON schema as compact JSON text; ValueError when it is not a JSON schema."""
    if schema is None:
        return None
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()  # a pydantic model class
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise TypeError("structured_outputs.json must be a JSON schema (an object), got "
                        f"{type(schema).__name__}")
    # Key order kept: a schema's property order is the order the output writes them in.
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


@dataclass
class SamplingParams:
    """How to sample one request's output tokens and when to stop.

    Validation raises `ValueError` naming the field, the value and the limit.
    """

    # Number of completions to generate for the prompt; each child gets `clone_for_child`.
    n: int = 1
    # Subtracted once from the logit of every token already present in the output.
    presence_penalty: float = 0.0
    # Subtracted from a token's logit once per occurrence of it in the output.
    frequency_penalty: float = 0.0
    # Tokens seen in the prompt or output: positive logits divided by it, negative multiplied.
    repetition_penalty: float = 1.0
    # Divides the logits before sampling; below GREEDY_TEMPERATURE_EPS means greedy.
    temperature: float = 1.0
    # Keep the smallest set of most likely tokens whose probability mass reaches top_p.
    top_p: float = 1.0
    # Keep the top_k most likely tokens; 0 or -1 disables the filter.
    top_k: int = 0
    # Drop tokens whose probability is below min_p times that of the most likely token.
    min_p: float = 0.0
    # Seed of this request's own random generator; None uses the engine's shared one.
    seed: int | None = None
    # Strings that end generation when they appear in the output text (a str is one stop).
    stop: str | list[str] | None = None
    # Token ids that end generation when sampled (in addition to EOS unless ignore_eos).
    stop_token_ids: list[int] | None = None
    # Keep generating after the model's EOS token.
    ignore_eos: bool = False
    # Most output tokens to generate; None means up to the model's context length.
    max_tokens: int | None = 16
    # EOS and stop_token_ids cannot be sampled before this many output tokens exist.
    min_tokens: int = 0
    # Number of top alternatives to return with each sampled token's logprob; None for none.
    logprobs: int | None = None
    # Drop special tokens (EOS, BOS, ...) from the output text.
    skip_special_tokens: bool = True
    # Keep the matched stop string at the end of the output text.
    include_stop_str_in_output: bool = False
    # A constraint the output text must satisfy (JSON schema, regex, choice, grammar).
    structured_outputs: StructuredOutputsParams | None = None
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (vLLM's allowed_token_ids); None allows all.
    allowed_token_ids: list[int] | None = None
    # Logprobs of every prompt token (but the first) with this many top alternatives, as
    # vLLM's prompt_logprobs; None for none. Such a request takes no prefix-cache hit: the
    # logprobs need every prompt position computed.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise TypeError("structured_outputs must be a StructuredOutputsParams, got "
                            f"{type(self.structured_outputs).__name__}")
        self._validate_counts()
        self._validate_filters()
        self._validate_penalties()
        self._validate_stops()
        self._validate_token_constraints()

    def _validate_counts(self) -> None:
        if not self.n >= 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens is not None and not self.max_tokens >= 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.min_tokens >= 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_NUM_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_NUM_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_NUM_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_NUM_LOGPROBS}], got "
                             f"{self.prompt_logprobs}")

    def _validate_filters(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.top_k == -1 or self.top_k >= 0):
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(
                    f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got {value}"
                )
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    def _validate_stops(self) -> None:
        for index, stop in enumerate(self.stop):
            if not stop:
                raise ValueError(f"stop[{index}] must be a non-empty string, got {stop!r}")
        for index, token_id in enumerate(self.stop_token_ids):
            if not token_id >= 0:
                raise ValueError(f"stop_token_ids[{index}] must be >= 0, got {token_id}")

    def _validate_token_constraints(self) -> None:
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise ValueError(f"logit_bias holds {len(self.logit_bias)} tokens, more than "
                                 f"the limit of {MAX_LOGIT_BIAS_ENTRIES}")
            for token_id, bias in self.logit_bias.items():
                if not token_id >= 0:
                    raise ValueError(f"logit_bias token ids must be >= 0, got {token_id}")
                if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                    raise ValueError(f"logit_bias[{token_id}] must be in "
                                     f"[-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], got {bias}")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty: nothing could be sampled")
            for index, token_id in enumerate(self.allowed_token_ids):
                if not token_id >= 0:
                    raise ValueError(f"allowed_token_ids[{index}] must be >= 0, got {token_id}")
            self.allowed_token_ids = list(self.allowed_token_ids)

    @property
    def has_token_constraints(self) -> bool:
        """Whether logit_bias or allowed_token_ids change this request's logits."""
        return self.logit_bias is not None or self.allowed_token_ids is not None

    @property
    def is_greedy(self) -> bool:
        """Whether sampling is argmax (temperature below GREEDY_TEMPERATURE_EPS)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def is_top_k_enabled(self) -> bool:
        """Whether top_k filters anything (0 and -1 both mean disabled)."""
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone_for_child(self, index: int) -> SamplingParams:
        """The params of the `index`-th of the n completions of one prompt.

        The child has n=1; a seeded parent gives child `index` the seed `seed + index`, so
        the n completions are reproducible and differ from one another.
        """
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)


def _normalize_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)
