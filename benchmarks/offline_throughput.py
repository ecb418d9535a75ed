"""Offline throughput: output tokens per second of kvferry against HF `generate`.

Builds a random-weight Llama checkpoint (8 layers x 512 hidden, GQA) and a word-level
tokenizer in a temporary directory, then runs one fixed workload through both:

- HF transformers `generate` in float32 with static batches in input order (left padding
  and an attention mask; every batch decodes as many tokens as its longest request asks
  for, EOS disabled), counting only the tokens each request asked for;
- kvferry `LLM.generate` with continuous batching, chunked prefill and per-request
  `max_tokens`.

Both see the same prompts (random token ids), greedy decoding and `ignore_eos`. The
baseline is HF at its fastest batch size, measured in a fresh process as a user runs it;
HF is also run once more in this process, after kvferry has tuned the allocator, and that
ratio is printed too. The last line printed is one JSON object with the figures.

`--embeds` runs the prompt-embeddings variant of the same workload instead (no HF): kvferry
with the same prompts given as their rows of the embedding table, over kvferry with them as
token ids (`embeds_ratio`, target >= 0.95), and token prompts on an engine with
`enable_prompt_embeds=True` over one without (`flag_cost_ratio`, target >= 0.98). The three
runs are interleaved over `--repeats` rounds and the best run of each compared (other work
on the host only adds time).

    python benchmarks/offline_throughput.py [--num-requests 64] [--hf-batch-size 16] [--quick]
    python benchmarks/offline_throughput.py --embeds [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

TARGET_RATIO = 3.0
TARGET_EMBEDS_RATIO = 0.95
TARGET_FLAG_COST_RATIO = 0.98
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
# Wider than HF's default 0.02, so greedy argmax is rarely a near-tie and the two engines'
# outputs can be compared token for token.
INIT_RANGE = 0.1


@dataclass(frozen=True)
class ModelShape:
    """The checkpoint's architecture fields."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int


@dataclass(frozen=True)
class Workload:
    """Prompts and output lengths, in request order."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass(frozen=True)
class RunResult:
    """One engine's pass over the workload."""

    seconds: float
    # Generated ids per request, cut to the requested length.
    outputs: list[list[int]]
    # Minor page faults during the run (kvferry only).
    page_faults: int = 0
    # CPU seconds (user + system) this process spent in the run (kvferry only): steadier
    # than the wall clock on a host busy with other work.
    cpu_seconds: float = 0.0

    def tokens_per_s(self, num_output_tokens: int) -> float:
        return num_output_tokens / self.seconds


FULL_SHAPE = ModelShape(8, 512, 8, 2, 1408, 8192, 1024)
QUICK_SHAPE = ModelShape(2, 128, 4, 2, 256, 1024, 1024)


# ---------------------------------------------------------------------- checkpoint
def quiet_hf() -> None:
    """No progress bars or generation warnings from transformers between our lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer whose vocabulary is exactly the model's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"<unk>": UNK_ID, "<s>": BOS_ID, "</s>": EOS_ID, "<pad>": PAD_ID}
    vocab = dict(specials)
    vocab.update({f"tok{i}": i for i in range(len(specials), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
    )
    fast.save_pretrained(str(path))


def build_checkpoint(path: Path, shape: ModelShape, seed: int) -> None:
    """Writes config, safetensors weights and tokenizer of a random Llama to `path`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=False,
        initializer_range=INIT_RANGE,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path), safe_serialization=True)
    save_word_tokenizer(path, shape.vocab_size)


# ---------------------------------------------------------------------- workload
def make_workload(
    num_requests: int,
    prompt_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> Workload:
    """Random prompts (no special tokens) and output lengths, both uniform and inclusive."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_len_range[0], prompt_len_range[1] + 1, num_requests)
    output_lens = rng.integers(output_len_range[0], output_len_range[1] + 1, num_requests)
    prompts = [rng.integers(PAD_ID + 1, vocab_size, int(n)).tolist() for n in prompt_lens]
    return Workload(prompts, [int(n) for n in output_lens])


# ---------------------------------------------------------------------- HF baseline
def load_hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def hf_generate_batch(model: Any, prompts: list[list[int]], max_new_tokens: int,
                      device: torch.device | None = None) -> list[list[int]]:
    """Greedy `generate` of one left-padded static batch (on `device`, else the CPU);
    returns the new ids per row."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=[],
        pad_token_id=PAD_ID,
    )
    with torch.inference_mode():
        if device is not None:
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config
        )
    return out[:, width:].tolist()


def run_hf(model: Any, workload: Workload, batch_size: int) -> RunResult:
    """Static batches in input order; each decodes the longest output its batch asks for."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first:first + batch_size]
        lens = workload.output_lens[first:first + batch_size]
        generated = hf_generate_batch(model, prompts, max(lens))
        outputs.extend(ids[:n] for ids, n in zip(generated, lens))
    return RunResult(time.perf_counter() - start, outputs)


# ---------------------------------------------------------------------- kvferry
def make_llm(path: Path, max_num_seqs: int, max_num_batched_tokens: int,
             enable_prompt_embeds: bool = False, kv_cache_memory_bytes: int | None = None) -> Any:
    from kvferry import LLM

    return LLM(
        model=str(path),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        device="cpu",
        enable_prompt_embeds=enable_prompt_embeds,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
    )


def run_kvferry(llm: Any, workload: Workload,
                prompts: list[dict[str, Any]] | None = None) -> RunResult:
    """The workload through `llm`; `prompts` replaces its token-id prompts (embeddings)."""
    from kvferry import SamplingParams

    if prompts is None:
        prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        for n in workload.output_lens
    ]
    faults, cpu = minor_page_faults(), cpu_seconds()
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    faults, cpu = minor_page_faults() - faults, cpu_seconds() - cpu
    return RunResult(seconds, [list(r.outputs[0].token_ids) for r in results], faults, cpu)


def cpu_seconds() -> float:
    """User and system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def minor_page_faults() -> int:
    """Minor page faults of this process so far (fresh memory the kernel had to map)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ---------------------------------------------------------------------- report
def check_lengths(name: str, result: RunResult, workload: Workload) -> None:
    got = [len(o) for o in result.outputs]
    if got != workload.output_lens:
        bad = next(i for i, (g, w) in enumerate(zip(got, workload.output_lens)) if g != w)
        raise RuntimeError(
            f"{name}: request {bad} produced {got[bad]} tokens, asked for "
            f"{workload.output_lens[bad]}"
        )


def agreement(a: RunResult, b: RunResult) -> tuple[int, float]:
    """(requests with identical outputs, mean fraction of leading tokens that agree)."""
    identical, prefix_fractions = 0, []
    for x, y in zip(a.outputs, b.outputs):
        identical += x == y
        common = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        prefix_fractions.append(common / max(len(x), 1))
    return identical, float(np.mean(prefix_fractions))


def measure_hf(
    path: Path, workload: Workload, warmup: Workload, batch_sizes: list[int]
) -> dict[int, RunResult]:
    """HF `generate` over the workload at each static batch size, in this process."""
    quiet_hf()
    model = load_hf_model(path)
    hf_generate_batch(model, warmup.prompts, 4)
    runs = {}
    for batch_size in batch_sizes:
        runs[batch_size] = run_hf(model, workload, batch_size)
        check_lengths("hf", runs[batch_size], workload)
    return runs


def measure_hf_in_fresh_process(
    path: Path, workload: Workload, warmup: Workload, batch_sizes: list[int]
) -> dict[int, RunResult]:
    """`measure_hf` in a new interpreter: HF runs as a user would run it, with none of the
    process-wide state kvferry sets up (allocator settings, loaded kernels)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(measure_hf, path, workload, warmup, batch_sizes).result()


def compare_with_hf(
    args: argparse.Namespace, path: Path, workload: Workload, warmup: Workload,
    kvferry: RunResult,
) -> dict[str, Any]:
    """The baseline is HF at its best batch size, in a fresh process; HF at that batch size
    is also run in this process (after kvferry tuned malloc) as a second reference."""
    num_tokens = workload.num_output_tokens
    kv_tps = kvferry.tokens_per_s(num_tokens)
    hf_runs = measure_hf_in_fresh_process(path, workload, warmup, args.hf_batch_size)
    for batch_size, run in hf_runs.items():
        print(f"hf generate (fresh process): {run.seconds:.2f} s, "
              f"{run.tokens_per_s(num_tokens):.1f} output tokens/s "
              f"(static batches of {batch_size})")
    best = min(hf_runs, key=lambda b: hf_runs[b].seconds)
    hf_tps = hf_runs[best].tokens_per_s(num_tokens)
    same = measure_hf(path, workload, warmup, [best])[best]
    same_tps = same.tokens_per_s(num_tokens)
    print(f"hf generate (this process, kvferry's malloc settings): {same.seconds:.2f} s, "
          f"{same_tps:.1f} output tokens/s (static batches of {best})")
    identical, prefix = agreement(kvferry, hf_runs[best])
    ratio = kv_tps / hf_tps
    print(f"greedy agreement: {identical}/{len(workload.prompts)} requests identical, "
          f"{prefix:.1%} of tokens before the first difference")
    print(f"ratio kvferry / hf (batch {best}, fresh process): {ratio:.2f} "
          f"(target >= {TARGET_RATIO}); against hf in this process: {kv_tps / same_tps:.2f}")
    return {
        "hf_tokens_per_s": round(hf_tps, 2),
        "hf_seconds": round(hf_runs[best].seconds, 3),
        "hf_batch_size": best,
        "hf_tokens_per_s_by_batch_size": {
            b: round(r.tokens_per_s(num_tokens), 2) for b, r in hf_runs.items()
        },
        "hf_same_process_tokens_per_s": round(same_tps, 2),
        "ratio": round(ratio, 3),
        "ratio_vs_hf_same_process": round(kv_tps / same_tps, 3),
        "target_ratio": TARGET_RATIO,
        "identical_outputs": identical,
    }


# ---------------------------------------------------------------------- prompt embeddings
def embeds_prompts(path: Path, workload: Workload) -> list[dict[str, Any]]:
    """The workload's prompts as their rows of the checkpoint's embedding table: what the
    model computes from the token ids, so greedy outputs must agree."""
    from safetensors.torch import load_file

    table = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"]
    return [{"prompt_embeds": table[prompt]} for prompt in workload.prompts]


def compare_embeds(args: argparse.Namespace, path: Path, workload: Workload,
                   warmup: Workload) -> dict[str, Any]:
    """Token prompts on an engine without the flag and with it, and embedding prompts with
    it, interleaved over `args.repeats` rounds; the best output tokens/s of each."""
    # Two engines live at once: each gets the KV memory the workload needs at most.
    kv_bytes = 512 * 1024 * 1024
    engines = {
        "tokens_flag_off": make_llm(path, args.max_num_seqs, args.max_num_batched_tokens,
                                    False, kv_bytes),
        "tokens_flag_on": make_llm(path, args.max_num_seqs, args.max_num_batched_tokens,
                                   True, kv_bytes),
    }
    embeds = embeds_prompts(path, workload)
    runs: dict[str, list[RunResult]] = {"tokens_flag_off": [], "tokens_flag_on": [],
                                        "embeds": []}
    variants = [("tokens_flag_off", "tokens_flag_off", None),
                ("tokens_flag_on", "tokens_flag_on", None),
                ("embeds", "tokens_flag_on", embeds)]
    for engine in engines.values():
        run_kvferry(engine, warmup)
    run_kvferry(engines["tokens_flag_on"], warmup, embeds_prompts(path, warmup))
    num_tokens = workload.num_output_tokens
    for round_index in range(args.repeats):
        # Each round starts with another variant, so none always follows the same one.
        shift = round_index % len(variants)
        for name, engine, prompts in variants[shift:] + variants[:shift]:
            # Every run computes its prompts: none finds them cached by an earlier round.
            if not engines[engine].llm_engine.kv_cache_manager.reset_prefix_cache():
                raise RuntimeError(f"{engine}: blocks still in use after a run")
            result = run_kvferry(engines[engine], workload, prompts)
            check_lengths(name, result, workload)
            runs[name].append(result)
            print(f"round {round_index + 1} {name}: {result.seconds:.2f} s, "
                  f"{result.tokens_per_s(num_tokens):.1f} output tokens/s; "
                  f"{result.cpu_seconds:.2f} CPU s")
    # Best of the rounds: other work on the host only ever adds time to a run, so the
    # fastest run of each is the one least disturbed (medians are reported beside).
    best = {name: max(r.tokens_per_s(num_tokens) for r in results)
            for name, results in runs.items()}
    median = {name: float(np.median([r.tokens_per_s(num_tokens) for r in results]))
              for name, results in runs.items()}
    # Output tokens per CPU second: what the work costs, whatever else the host runs.
    per_cpu = {name: max(num_tokens / r.cpu_seconds for r in results)
               for name, results in runs.items()}
    identical, _ = agreement(runs["embeds"][0], runs["tokens_flag_on"][0])
    embeds_ratio = best["embeds"] / best["tokens_flag_on"]
    flag_cost_ratio = best["tokens_flag_on"] / best["tokens_flag_off"]
    embeds_ratio_cpu = per_cpu["embeds"] / per_cpu["tokens_flag_on"]
    flag_cost_ratio_cpu = per_cpu["tokens_flag_on"] / per_cpu["tokens_flag_off"]
    print(f"greedy agreement, embeddings vs token ids: {identical}/{len(workload.prompts)} "
          "requests identical")
    print(f"embeds_ratio (embedding prompts / the same as token ids): {embeds_ratio:.3f} "
          f"(target >= {TARGET_EMBEDS_RATIO}); by CPU time: {embeds_ratio_cpu:.3f}")
    print(f"flag_cost_ratio (token prompts, flag on / off): {flag_cost_ratio:.3f} "
          f"(target >= {TARGET_FLAG_COST_RATIO}); by CPU time: {flag_cost_ratio_cpu:.3f}")
    return {
        "embeds_ratio": round(embeds_ratio, 3),
        "flag_cost_ratio": round(flag_cost_ratio, 3),
        "target_embeds_ratio": TARGET_EMBEDS_RATIO,
        "target_flag_cost_ratio": TARGET_FLAG_COST_RATIO,
        "embeds_ratio_cpu": round(embeds_ratio_cpu, 3),
        "flag_cost_ratio_cpu": round(flag_cost_ratio_cpu, 3),
        "tokens_per_s": {name: round(value, 2) for name, value in best.items()},
        "median_tokens_per_s": {name: round(value, 2) for name, value in median.items()},
        "tokens_per_cpu_s": {name: round(value, 2) for name, value in per_cpu.items()},
        "identical_outputs": identical,
        "repeats": args.repeats,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, nargs="+", default=[16, 32],
                        help="HF static batch sizes to run; the fastest is the baseline")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model and workload: a smoke run of a few seconds")
    parser.add_argument("--skip-hf", action="store_true",
                        help="measure kvferry only (no ratio)")
    parser.add_argument("--embeds", action="store_true",
                        help="the prompt-embeddings variant: embedding prompts against token "
                             "prompts, and the flag's cost on token prompts (no HF)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="--embeds: interleaved rounds; the best run of each variant "
                             "is compared")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    quiet_hf()
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    num_requests = min(args.num_requests, 8) if args.quick else args.num_requests
    prompt_range, output_range = ((8, 64), (4, 32)) if args.quick else ((32, 512), (32, 256))
    workload = make_workload(num_requests, prompt_range, output_range, shape.vocab_size, args.seed)
    warmup = make_workload(4, (16, 64), (4, 8), shape.vocab_size, args.seed + 1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"model: {shape}")
    print(f"workload: {num_requests} requests, prompts {prompt_range}, outputs {output_range}: "
          f"{workload.num_prompt_tokens} prompt and {workload.num_output_tokens} output tokens")

    with tempfile.TemporaryDirectory(prefix="kvferry-bench-") as tmp:
        path = Path(tmp)
        build_checkpoint(path, shape, args.seed)
        if args.embeds:
            figures = compare_embeds(args, path, workload, warmup)
            figures.update(num_requests=num_requests,
                           output_tokens=workload.num_output_tokens)
            print(json.dumps(figures))
            return

        llm = make_llm(path, args.max_num_seqs, args.max_num_batched_tokens)
        run_kvferry(llm, warmup)
        kvferry = run_kvferry(llm, workload)
        check_lengths("kvferry", kvferry, workload)
        kv_tps = kvferry.tokens_per_s(workload.num_output_tokens)
        print(f"kvferry: {kvferry.seconds:.2f} s, {kv_tps:.1f} output tokens/s "
              f"(max_num_seqs {args.max_num_seqs}, "
              f"max_num_batched_tokens {args.max_num_batched_tokens}); "
              f"{kvferry.page_faults} minor page faults")
        del llm

        figures: dict[str, Any] = {
            "kvferry_tokens_per_s": round(kv_tps, 2),
            "kvferry_seconds": round(kvferry.seconds, 3),
            "kvferry_minor_page_faults": kvferry.page_faults,
        }
        if not args.skip_hf:
            figures.update(compare_with_hf(args, path, workload, warmup, kvferry))
    figures.update(num_requests=num_requests, output_tokens=workload.num_output_tokens)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
