"""Constraints compiled to grammars of llguidance, the grammar engine (used by vLLM too).

A request's `StructuredOutputsParams` names one constraint; `grammar_text` turns it into
llguidance's grammar, and a `GrammarCompiler` (one tokenizer, one cache) checks it and builds
the matcher that says, token by token, which tokens may come next.

Why llguidance rather than xgrammar (both serve vLLM): the time to fill one step's masks
for 64 rows in different states, measured on this project's 2-core CPU machine with
`benchmarks/structured.py --compare-engines` (four nested JSON schemas with enums, bounded
strings and integers, patterns; rows following real constrained outputs): with a 32k-token
byte-level vocabulary llguidance took a median 1.2 ms per step (90th percentile 2.0 ms),
xgrammar's batch matcher 6.2-7.9 ms (p90 12-18 ms); with a 2k vocabulary 0.4 ms against
0.4 ms (p90 0.5 against 5.1). A single-schema probe with a 128k vocabulary gave 1.0-1.2 ms
against 1.2-1.3 ms (p90 1.3-1.5 against 3.1-3.5). llguidance also builds its view of the
tokenizer from `tokenizer.json` itself (the only tokenizer format kvferry reads), compiles
lazily (a schema in about a millisecond; no precomputation over the vocabulary) and is one
wheel with no dependencies, where xgrammar imports transformers.

The module imports llguidance only when a constraint is first compiled, so a server that
never sees one never loads it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvferry.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

# JSON is generated with the separators of `json.dumps` and no other whitespace: a model
# that may put whitespace anywhere can put it everywhere, and a weak model does, until the
# length cap; one fixed spelling always makes progress.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
}
# The schema of `json_object` (OpenAI's `response_format: {"type": "json_object"}`).
ANY_OBJECT_SCHEMA = {"type": "object"}
# Compiled grammars kept per compiler (least recently used dropped first).
MAX_CACHED_GRAMMARS = 256
# A compile's outcome: (the start-state matcher, "") or (None, why it does not compile).
Compiled = tuple["llguidance.LLMatcher | None", str]


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for a constraint; ValueError when it cannot be written."""
    from llguidance import LLMatcher

    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = ANY_OBJECT_SCHEMA if kind == "json_object" else spec.json
        options = {**JSON_OPTIONS, "lenient": not spec.strict}
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)  # type: ignore[arg-type]
    if kind == "choice":
        # Lark string literals take JSON's escapes, so any string is one literal.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice or ())
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return LLMatcher.grammar_from_lark(_as_lark(spec.grammar or ""))


def _as_lark(grammar: str) -> str:
    """Lark as it is; GBNF (llama.cpp's `rule ::= ...`, vLLM's EBNF) converted to Lark."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except Exception as exc:  # noqa: BLE001 - the converter raises its own types and plain ones
        raise ValueError(f"the GBNF grammar cannot be read: {exc}") from None


def read_tokenizer_json(tokenizer_dir: Path) -> str:
    """The checkpoint's `tokenizer.json` as llguidance reads it (padding and truncation off)."""
    import tokenizers

    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{tokenizer_dir} has no tokenizer.json, which structured outputs need")
    backend = tokenizers.Tokenizer.from_file(str(path))
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


class GrammarCompiler:
    """Checks constraints and builds their matchers for one tokenizer; thread-safe.

    Each distinct constraint is compiled once: later requests for it copy the compiled
    matcher (a copy takes about a microsecond; compiling a large schema, milliseconds).
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        """`vocab_size`: the model's (its logits' width)."""
        import llguidance
        import tokenizers

        # Token ids the matchers know: the model's, or more when the tokenizer has tokens
        # past them (those are never sampled; their bits fall outside the logits).
        num_tokens = tokenizers.Tokenizer.from_str(tokenizer_json).get_vocab_size(True)
        self.mask_vocab_size = max(vocab_size, num_tokens)
        try:
            self.tokenizer = llguidance.LLTokenizer(
                tokenizer_json, n_vocab=self.mask_vocab_size,
                eos_token=list(eos_token_ids) or None)
        except ValueError as exc:
            raise ValueError(
                "structured outputs are not available for this model: the grammar engine "
                f"cannot read its tokenizer ({exc}); it needs a byte-level BPE or "
                "SentencePiece-style tokenizer") from None
        self._lock = threading.Lock()
        # Distinct constraints compiled so far (a cache hit compiles nothing).
        self.num_compiled = 0
        # Constraint key -> (the compiled matcher in its start state, None) or (None, why it
        # does not compile).
        self._cache: OrderedDict[tuple[str, str, bool], Compiled] = OrderedDict()

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher in the constraint's start state, for one request to advance.

        ValueError names what is wrong with the constraint (cached like a grammar).
        """
        key = spec.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        if compiled is None:
            compiled = self._build(spec)
            with self._lock:
                self._cache[key] = compiled
                while len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        matcher, error = compiled
        if matcher is None:
            raise ValueError(error)
        return matcher.deep_copy()

    def check(self, spec: StructuredOutputsParams) -> None:
        """ValueError when the constraint cannot be compiled (what `compile` would raise)."""
        self.compile(spec)

    def _build(self, spec: StructuredOutputsParams) -> Compiled:
        """The start-state matcher, or why the constraint does not compile."""
        import llguidance

        self.num_compiled += 1
        try:
            text = grammar_text(spec)
        except ValueError as exc:
            return None, _describe(spec, str(exc))
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            return None, _describe(spec, matcher.get_error())
        return matcher, ""


_KIND_NAMES = {"json": "the JSON schema", "json_object": "the JSON object grammar",
               "regex": "the regex", "choice": "the choice", "grammar": "the grammar"}


def _describe(spec: StructuredOutputsParams, problem: str) -> str:
    # The engine's messages can run over many lines (a caret under the place); one is enough
    # to name the problem, and the rest stays in the message for whoever reads it whole.
    return f"{_KIND_NAMES[spec.kind]} cannot be compiled: {problem.strip()}"
