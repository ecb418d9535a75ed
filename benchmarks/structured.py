"""Structured outputs: offline throughput with every request under a JSON schema against the
same workload unconstrained, and the grammar engine's mask time per step at batch 64.

The model is a random-weight Llama (8 layers x 512 hidden, GQA, float32) with a byte-level
BPE tokenizer of `--vocab-size` tokens trained on the Python standard library's sources, so
JSON can be written in its tokens and the masks are as wide as a real vocabulary's. The
workload is `--num-requests` prompts of random token ids, each request under one of four
JSON schemas (nested objects, arrays, enums, bounded strings and integers), sampled at
temperature 1 with a seed per request:

1. constrained, a warm-up: the prompts are computed (later passes find them in the prefix
   cache, so every measured pass is decode, where a mask weighs most against a step), the
   grammars compiled, and each request's output length recorded;
2. unconstrained: the same prompts and seeds, `ignore_eos`, and each request's
   `max_tokens` set to the length of its constrained output, so both passes generate
   exactly the same number of tokens for every request;
3. constrained again: the figure the ratio uses, against 2.

Compiling is timed on its own: a fresh compiler's set-up (the grammar engine's view of the
tokenizer, once per process) and each schema's first compile.

Every constrained output must parse and validate against its schema (`jsonschema`).

Passes 2 and 3 alternate `--repeats` times and the fastest of each counts, so load from
elsewhere on the machine weighs on both alike. Also reported: how long the steps of the
warm passes waited for their bitmask (the part of the mask work the model did not hide).

Mask time per step at batch 64: 64 matchers, row r following the constrained outputs of
pass 1 token by token (r, r + 64, ... cyclically, a fresh matcher for each, so the rows are
in different states), have their bitmask filled together per step exactly as the engine
fills it (`fill_bitmask`) for `--mask-steps` steps; the median, 90th percentile and mean
are reported, with the time to advance the 64 matchers by their tokens.
`--compare-engines` measures xgrammar's batch matcher on the same rows when it is installed
(the measurement behind the choice of llguidance, engine/structured_output/grammar.py).

    python benchmarks/structured.py [--num-requests 64] [--vocab-size 32000] [--quick]
                                    [--compare-engines]

The last line printed is one JSON object with the figures; `ratio` is warm constrained
tokens/s over unconstrained tokens/s (target >= 0.9).
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch

TARGET_RATIO = 0.9
MASK_BATCH = 64
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
# Four shapes of answer; every string and array is bounded, so a random model closes each
# object within MAX_TOKENS.
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["name", "age", "colour", "address"], "additionalProperties": False},
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -99,
                                              "maximum": 99}, "maxItems": 5},
        "ok": {"type": "boolean"}},
     "required": ["tags", "scores", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "count": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "count"], "additionalProperties": False}},
        "note": {"type": "string", "maxLength": 20}},
     "required": ["items", "note"], "additionalProperties": False},
    {"type": "object", "properties": {
        "event": {"enum": ["start", "stop", "pause", "resume"]},
        "at": {"type": "integer", "minimum": 0, "maximum": 99999},
        "by": {"type": "object", "properties": {
            "user": {"type": "string", "maxLength": 10},
            "role": {"enum": ["admin", "guest"]}},
            "required": ["user", "role"], "additionalProperties": False}},
     "required": ["event", "at", "by"], "additionalProperties": False},
]
MAX_TOKENS = 400


# ---------------------------------------------------------------------- checkpoint
def train_tokenizer(path: Path, vocab_size: int, max_files: int) -> int:
    """A byte-level BPE of `vocab_size` tokens (specials first) trained on the standard
    library's sources, written as `path/tokenizer.json`; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "**" / "*.py"),
                             recursive=True))[:max_files]

    def texts() -> Any:
        for name in files:
            with open(name, encoding="utf-8", errors="ignore") as f:
                yield f.read()

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}))
    return tokenizer.get_vocab_size(with_added_tokens=True)


def build_checkpoint(path: Path, vocab_size: int, quick: bool, max_files: int) -> int:
    """Tokenizer, config and random float32 weights of a Llama; returns the vocabulary size."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    vocab = train_tokenizer(path, vocab_size, max_files)
    layers, hidden, heads, inter = (2, 128, 4, 256) if quick else (8, 512, 8, 1408)
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"], num_hidden_layers=layers, hidden_size=hidden,
        num_attention_heads=heads, num_key_value_heads=2, intermediate_size=inter,
        vocab_size=vocab, max_position_embeddings=1024, tie_word_embeddings=False,
        initializer_range=0.1, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path), safe_serialization=True)
    return vocab


# ---------------------------------------------------------------------- passes
def make_prompts(num_requests: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(32, 257, num_requests)
    return [rng.integers(len(SPECIALS), vocab_size, int(n)).tolist() for n in lengths]


def constrained_params(num_requests: int) -> list[Any]:
    from kvferry.engine.sampling_params import SamplingParams, StructuredOutputsParams

    return [SamplingParams(max_tokens=MAX_TOKENS, seed=1000 + i,
                           structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % 4]))
            for i in range(num_requests)]


def timed_generate(llm: Any, prompts: list[list[int]], params: list[Any]
                   ) -> tuple[float, list[list[int]], list[str]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return (seconds, [list(o.outputs[0].token_ids) for o in outputs],
            [o.outputs[0].text for o in outputs])


def check_outputs(texts: list[str]) -> int:
    """How many outputs parse and validate against their request's schema."""
    import jsonschema

    valid = 0
    for i, text in enumerate(texts):
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[i % 4])
        except (ValueError, jsonschema.ValidationError):
            continue
        valid += 1
    return valid


class MaskWaits:
    """Time the runner spends waiting for each step's bitmask (what the mask costs a step
    beyond what overlaps with the model)."""

    def __init__(self) -> None:
        from kvferry.engine.structured_output.manager import GrammarBitmask

        self.cls = GrammarBitmask
        self.original: Callable[..., torch.Tensor] = GrammarBitmask.result
        self.seconds: list[float] = []

    def __enter__(self) -> Self:
        original, seconds = self.original, self.seconds

        def result(bitmask: Any) -> torch.Tensor:
            start = time.perf_counter()
            rows = original(bitmask)
            seconds.append(time.perf_counter() - start)
            return rows

        self.cls.result = result  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.cls.result = self.original  # type: ignore[method-assign]


# ---------------------------------------------------------------------- mask time
Matcher = Any


def drive_rows(sequences: list[list[int]], num_steps: int, new_matcher: Callable[[int], Matcher],
               fill: Callable[[list[Matcher]], None], consume: Callable[[Matcher, int], bool]
               ) -> tuple[list[float], list[float]]:
    """MASK_BATCH rows, row r following recorded outputs r, r + 64, ... (cyclically) token by
    token, a fresh matcher for each output: rows stay in different states throughout.
    Returns the seconds of each step's fill and of advancing the rows by one token."""
    rows = []
    for r in range(MASK_BATCH):
        index = r % len(sequences)
        rows.append([index, 0, new_matcher(index)])
    fills, advances = [], []
    for _ in range(num_steps):
        start = time.perf_counter()
        fill([row[2] for row in rows])
        fills.append(time.perf_counter() - start)
        start = time.perf_counter()
        for index, position, matcher in rows:
            if not consume(matcher, sequences[index][position]):
                raise RuntimeError("a recorded token does not fit its grammar")
        advances.append(time.perf_counter() - start)
        for row in rows:
            row[1] += 1
            if row[1] == len(sequences[row[0]]):  # the output ended: the row starts another
                row[0] = (row[0] + MASK_BATCH) % len(sequences)
                row[1], row[2] = 0, new_matcher(row[0])
    return fills, advances


def schema_of(index: int) -> dict[str, Any]:
    return SCHEMAS[index % len(SCHEMAS)]


def mask_time_llguidance(model_dir: Path, vocab_size: int, sequences: list[list[int]],
                         num_steps: int) -> dict[str, float]:
    """Per step, the bitmask of MASK_BATCH matchers in different states, filled as the
    engine fills it, and advancing them by one token each (as update_from_output does)."""
    import llguidance
    from kvferry.engine.sampling_params import StructuredOutputsParams
    from kvferry.engine.structured_output.grammar import GrammarCompiler, read_tokenizer_json
    from kvferry.engine.structured_output.manager import fill_bitmask, num_bitmask_words

    compiler = GrammarCompiler(read_tokenizer_json(model_dir), vocab_size, [EOS_ID])
    executor = llguidance.LLExecutor()
    buffer = torch.zeros((MASK_BATCH, num_bitmask_words(compiler.mask_vocab_size)),
                         dtype=torch.int32)
    fills, advances = drive_rows(
        sequences, num_steps,
        lambda i: compiler.compile(StructuredOutputsParams(json=schema_of(i))),
        lambda matchers: fill_bitmask(executor, matchers, buffer),
        lambda matcher, token: matcher.consume_token(token))
    return {**_stats("mask_ms", fills), **_stats("advance_ms", advances), "steps": num_steps}


def mask_time_xgrammar(model_dir: Path, vocab_size: int, sequences: list[list[int]],
                       num_steps: int) -> dict[str, Any] | None:
    """The same rows with xgrammar's batch matcher (outputs it does not accept whole are left
    out: the engines differ on a few corners of JSON schema); None when not installed."""
    try:
        import xgrammar
    except ImportError:
        return None
    import tokenizers

    backend = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    encoded = [""] * vocab_size
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if index < vocab_size:
            encoded[index] = token
    info = xgrammar.TokenizerInfo(encoded, vocab_type=xgrammar.VocabType.BYTE_LEVEL,
                                  vocab_size=vocab_size, stop_token_ids=[EOS_ID])
    compiler = xgrammar.GrammarCompiler(info)
    compiled = [compiler.compile_json_schema(json.dumps(s), any_whitespace=False,
                                             separators=(", ", ": ")) for s in SCHEMAS]

    def accepted(index: int) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled[index % len(SCHEMAS)])
        return all(matcher.accept_token(t) for t in sequences[index])

    # Indices kept, so each output keeps its schema.
    kept = [i for i in range(len(sequences)) if accepted(i)]
    if not kept:
        return {"note": "xgrammar accepts none of the outputs"}
    batch = xgrammar.BatchGrammarMatcher()
    bitmask = xgrammar.allocate_token_bitmask(MASK_BATCH, vocab_size)
    fills, _ = drive_rows(
        [sequences[i] for i in kept], num_steps,
        lambda i: xgrammar.GrammarMatcher(compiled[kept[i] % len(SCHEMAS)]),
        lambda matchers: batch.batch_fill_next_token_bitmask(matchers, bitmask),
        lambda matcher, token: matcher.accept_token(token))
    return {**_stats("mask_ms", fills), "steps": num_steps,
            "outputs_used": len(kept), "outputs": len(sequences)}


def compile_times(model_dir: Path, vocab_size: int) -> dict[str, float]:
    """Milliseconds of a fresh compiler's set-up and of each schema's first compile."""
    from kvferry.engine.sampling_params import StructuredOutputsParams
    from kvferry.engine.structured_output.grammar import GrammarCompiler, read_tokenizer_json

    start = time.perf_counter()
    compiler = GrammarCompiler(read_tokenizer_json(model_dir), vocab_size, [EOS_ID])
    times = {"tokenizer_setup": time.perf_counter() - start}
    for index, schema in enumerate(SCHEMAS):
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema))
        times[f"schema_{index}"] = time.perf_counter() - start
    return {name: round(seconds * 1e3, 3) for name, seconds in times.items()}


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {f"{name}_median": round(statistics.median(ms), 4),
            f"{name}_p90": round(float(np.percentile(ms, 90)), 4),
            f"{name}_mean": round(statistics.fmean(ms), 4)}


# ---------------------------------------------------------------------- main
def run(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from kvferry.engine.frontend.llm import LLM
    from kvferry.engine.sampling_params import SamplingParams

    started = time.perf_counter()
    vocab = build_checkpoint(model_dir, args.vocab_size, args.quick, args.max_files)
    print(f"checkpoint: vocabulary {vocab}, built in {time.perf_counter() - started:.1f} s")
    llm = LLM(str(model_dir), dtype="float32", max_model_len=1024, max_num_seqs=64,
              max_num_batched_tokens=2048, kv_cache_memory_bytes=1 << 30)
    prompts = make_prompts(args.num_requests, vocab)
    constrained = constrained_params(args.num_requests)
    _, outputs, texts = timed_generate(llm, prompts, constrained)
    lengths = [len(ids) for ids in outputs]
    free = [SamplingParams(max_tokens=n, seed=1000 + i, ignore_eos=True)
            for i, n in enumerate(lengths)]
    # Alternating passes, the best of each: other load on the machine hits both alike.
    free_s, warm_s = float("inf"), float("inf")
    with MaskWaits() as waits:
        for _ in range(args.repeats):
            seconds, free_outputs, _ = timed_generate(llm, prompts, free)
            assert [len(ids) for ids in free_outputs] == lengths
            free_s = min(free_s, seconds)
            seconds, warm_outputs, warm_texts = timed_generate(llm, prompts, constrained)
            # Seeded: every pass writes what the first one did, whatever the batching.
            assert warm_outputs == outputs, "seeded constrained outputs changed between passes"
            warm_s = min(warm_s, seconds)
    num_tokens = sum(lengths)
    valid = check_outputs(warm_texts)
    print(f"{args.num_requests} requests, {num_tokens} output tokens each pass; "
          f"{valid}/{len(texts)} constrained outputs parse and validate")
    result: dict[str, Any] = {
        "num_requests": args.num_requests, "num_output_tokens": num_tokens,
        "vocab_size": vocab, "grammar_engine": "llguidance",
        "unconstrained_tokens_per_s": round(num_tokens / free_s, 1),
        "constrained_tokens_per_s": round(num_tokens / warm_s, 1),
        "ratio": round(free_s / warm_s, 3),
        "target": TARGET_RATIO, "valid_outputs": valid,
        "mask_wait_ms_per_step": round(1e3 * statistics.fmean(waits.seconds), 4)
        if waits.seconds else 0.0,
    }
    print(f"unconstrained {result['unconstrained_tokens_per_s']} tok/s, constrained "
          f"{result['constrained_tokens_per_s']} tok/s; ratio {result['ratio']} "
          f"(target >= {TARGET_RATIO}); the step waited {result['mask_wait_ms_per_step']} ms "
          "for its mask on average")
    # The outputs that completed their grammar, each with its request's schema.
    complete = [ids if len(ids) < MAX_TOKENS else [] for ids in outputs]
    sequences = [ids for ids in complete if ids]
    assert len(sequences) == len(outputs), "an output ran out of tokens before its grammar"
    result["compile_ms"] = compile_times(model_dir, vocab)
    print(f"compiling: {result['compile_ms']}")
    result["mask_batch64"] = mask_time_llguidance(model_dir, vocab, sequences, args.mask_steps)
    print(f"llguidance, batch {MASK_BATCH}: {result['mask_batch64']}")
    if args.compare_engines:
        result["xgrammar_mask_batch64"] = mask_time_xgrammar(model_dir, vocab, sequences,
                                                             args.mask_steps)
        print(f"xgrammar, batch {MASK_BATCH}: {result['xgrammar_mask_batch64']}")
    llm.llm_engine.engine_core.shutdown()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=32000,
                        help="tokens of the trained byte-level BPE (128000 takes minutes)")
    parser.add_argument("--max-files", type=int, default=4000,
                        help="standard-library files the tokenizer is trained on")
    parser.add_argument("--repeats", type=int, default=2,
                        help="unconstrained and warm constrained passes, alternating; the "
                             "best of each is used")
    parser.add_argument("--mask-steps", type=int, default=200,
                        help="steps of the batch-64 mask measurement")
    parser.add_argument("--quick", action="store_true",
                        help="a 2-layer model, 16 requests and a 2k vocabulary: seconds")
    parser.add_argument("--compare-engines", action="store_true",
                        help="also time xgrammar's masks on the same rows, when installed")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.vocab_size, args.max_files = 16, 2000, 200
        args.repeats, args.mask_steps = 1, 50
    with tempfile.TemporaryDirectory(prefix="kvferry-structured-") as tmp:
        result = run(args, Path(tmp))
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
