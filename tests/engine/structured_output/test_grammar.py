"""Constraints compiled to llguidance grammars with a real byte-level tokenizer (the demo
checkpoint's): what each kind accepts, what fails to compile and why, and the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvferry.engine.frontend.tokenizer import Tokenizer
from kvferry.engine.sampling_params import StructuredOutputsParams
from kvferry.engine.structured_output.grammar import GrammarCompiler, read_tokenizer_json
from kvferry_testing.checkpoints import EOS_ID


@pytest.fixture(scope="module")
def tokenizer(demo_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_checkpoint)


@pytest.fixture
def compiler(demo_checkpoint: Path, tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(read_tokenizer_json(demo_checkpoint), tokenizer.vocab_size, [EOS_ID])


def accepts(compiler: GrammarCompiler, tokenizer: Tokenizer, spec: StructuredOutputsParams,
            text: str) -> bool:
    """Whether the constraint takes `text` whole (as the tokenizer splits it) and may end."""
    matcher = compiler.compile(spec)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
    "required": ["name", "tags"], "additionalProperties": False}


@pytest.mark.parametrize(("spec", "good", "bad"), [
    (StructuredOutputsParams(json=SCHEMA), '{"name": "x y", "tags": ["a", "b"]}',
     '{"name": "x", "tags": ["c"]}'),
    (StructuredOutputsParams(json=SCHEMA), '{"name": "", "tags": []}', '{"tags": []}'),
    # One spelling of JSON: json.dumps's separators, no other whitespace.
    (StructuredOutputsParams(json=SCHEMA), '{"name": "", "tags": []}', '{"name":"", "tags": []}'),
    (StructuredOutputsParams(json_object=True), '{"k": [1, {"x": null}]}', '[1]'),
    (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]+"), "123-ab", "12-ab"),
    (StructuredOutputsParams(choice=['say "hi"', "new\nline", "ünï"]), "new\nline", "new"),
    (StructuredOutputsParams(grammar='start: "a" ("b" | "c")* "!"'), "abcb!", "ab"),
    # GBNF (llama.cpp's syntax, vLLM's EBNF) is converted to Lark.
    (StructuredOutputsParams(grammar='root ::= "yes" | "no" digit\ndigit ::= [0-9]'), "no7",
     "no"),
])
def test_each_kind_accepts_what_it_describes_and_nothing_else(
        compiler: GrammarCompiler, tokenizer: Tokenizer, spec: StructuredOutputsParams,
        good: str, bad: str) -> None:
    assert accepts(compiler, tokenizer, spec, good)
    assert not accepts(compiler, tokenizer, spec, bad)


def test_a_complete_object_leaves_only_eos(compiler: GrammarCompiler,
                                           tokenizer: Tokenizer) -> None:
    matcher = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    assert matcher.consume_tokens(tokenizer.encode('{"name": "", "tags": []}',
                                                   add_special_tokens=False))
    assert matcher.is_stopped()
    assert matcher.consume_token(EOS_ID)


@pytest.mark.parametrize(("spec", "message"), [
    (StructuredOutputsParams(json={"type": "objekt"}),
     "the JSON schema cannot be compiled: Invalid type: objekt"),
    (StructuredOutputsParams(json={"type": "string", "format": "madeup"}),
     "the JSON schema cannot be compiled: Unknown format: madeup"),
    (StructuredOutputsParams(regex="a(b"), "the regex cannot be compiled: "),
    (StructuredOutputsParams(regex="(?<=a)b"), "the regex cannot be compiled: "),
    (StructuredOutputsParams(grammar="start: foo"), 'the grammar cannot be compiled: '),
])
def test_a_constraint_that_does_not_compile_says_what_and_why(
        compiler: GrammarCompiler, spec: StructuredOutputsParams, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        compiler.compile(spec)
    assert str(raised.value).startswith(message), raised.value
    # The failure is cached as well: asking again compiles nothing more.
    num_compiled = compiler.num_compiled
    with pytest.raises(ValueError, match="cannot be compiled"):
        compiler.check(spec)
    assert compiler.num_compiled == num_compiled == 1


def test_regex_and_lark_failures_name_the_place(compiler: GrammarCompiler) -> None:
    with pytest.raises(ValueError, match="unclosed group"):
        compiler.check(StructuredOutputsParams(regex="a(b"))
    with pytest.raises(ValueError, match='unknown name: "foo"'):
        compiler.check(StructuredOutputsParams(grammar="start: foo"))


def test_strict_false_ignores_keywords_it_cannot_enforce(compiler: GrammarCompiler,
                                                         tokenizer: Tokenizer) -> None:
    spec = StructuredOutputsParams(json={"type": "string", "format": "madeup"}, strict=False)
    assert accepts(compiler, tokenizer, spec, '"anything"')


def test_each_distinct_constraint_is_compiled_once(compiler: GrammarCompiler,
                                                   tokenizer: Tokenizer) -> None:
    first = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    # The same schema spelled as text, and a second matcher: a copy, not a compile.
    second = compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    assert compiler.num_compiled == 1
    # Copies advance on their own: the same start fits each of them.
    start = tokenizer.encode('{"name": "", ', add_special_tokens=False)
    assert first.consume_tokens(start) and second.consume_tokens(start)
    compiler.compile(StructuredOutputsParams(json=SCHEMA, strict=False))
    compiler.compile(StructuredOutputsParams(regex="[0-9]+"))
    assert compiler.num_compiled == 3


def test_a_word_level_tokenizer_cannot_take_constraints(make_checkpoint) -> None:
    path = make_checkpoint(vocab_size=64)
    with pytest.raises(ValueError, match="^structured outputs are not available for this "
                                         "model: the grammar engine cannot read its tokenizer"):
        GrammarCompiler(read_tokenizer_json(path), 64, [EOS_ID])


def test_a_tokenizer_with_more_tokens_than_the_model_widens_the_masks(
        demo_checkpoint: Path, tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(read_tokenizer_json(demo_checkpoint), 1000, [EOS_ID])
    assert compiler.mask_vocab_size == tokenizer.vocab_size > 1000
