"""Measures launch shapes of the unified attention kernel on this GPU and writes the fastest
as a tuning table (the form `engine/attention/triton/_attention_launch.py` reads).

Shapes measured (bf16, block size 16, blocks shuffled, inputs random):

- decode, Llama-8B heads (32 query heads, 8 KV heads, head size 128): batch 64 at 4k and
  16k tokens of context; Llama-3.2-1B heads (head size 64): batch 128 at 1k;
- prefill, the same heads: one 8k-token sequence and 16 x 1k (head size 128), one 8k
  sequence (head size 64).

For each kind and head size every candidate (query rows per program, keys per tile, warps,
pipeline stages) is checked against `scaled_dot_product_attention` on the same keys made
contiguous (relative error, output poisoned first) and timed (CUDA events, median); the
candidate with the least total time over the kind's shapes wins. Then decode tries split-KV
(2, 4, 8 ranges) with its winner, and the table's split policy keeps the program count that
paid. Candidates compile in parallel worker processes first (Triton's cache is shared), so
the timing loop only loads them.

    python benchmarks/attention_tuning.py [--out tuning.json] [--budget-s 150] [--quick]
    TRITON_INTERPRET=1 python benchmarks/attention_tuning.py --smoke   # the script, on CPU

`KVFERRY_ATTENTION_TUNING=tuning.json` then makes every launch of a process use the table.
The last line printed is one JSON object: per shape the built-in and the tuned time, and
the table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels

BLOCK_SIZE = 16
DTYPE = torch.bfloat16
# --smoke: tiny shapes on the CPU under the Triton interpreter (the script's own test).
DEVICE = "cuda"
SPLITS = (2, 4, 8)
# Relative error (norm of the difference over the reference's) a candidate may have.
MAX_REL_ERROR = 2e-2


@dataclass(frozen=True)
class Shape:
    kind: str  # "decode" or "prefill"
    head_size: int
    num_seqs: int
    context: int  # keys per request; prefill requests also have this many queries
    num_heads: int = 32
    num_kv_heads: int = 8

    @property
    def name(self) -> str:
        return f"{self.kind}_d{self.head_size}_{self.num_seqs}x{self.context}"

    @property
    def query_len(self) -> int:
        return 1 if self.kind == "decode" else self.context

    def kv_bytes(self) -> int:
        return 2 * self.num_seqs * self.context * self.num_kv_heads * self.head_size * 2


# Kinds interleaved, so that a budget cut short leaves each kind at least one full shape.
SHAPES = (
    Shape("decode", 128, 64, 4096),
    Shape("prefill", 128, 1, 8192),
    Shape("decode", 64, 128, 1024),
    Shape("prefill", 64, 1, 8192),
    Shape("decode", 128, 64, 16384),
    Shape("prefill", 128, 16, 1024),
)
SMOKE_SHAPES = (
    Shape("decode", 32, 3, 64, num_heads=4, num_kv_heads=2),
    Shape("prefill", 32, 2, 48, num_heads=4, num_kv_heads=2),
)


def candidates(kind: str, quick: bool) -> list[dict[str, int]]:
    """TileConfig fields to try for a kind of launch."""
    if kind == "decode":
        grid = itertools.product([16], [32, 64, 128] if not quick else [64],
                                 [2, 4, 8] if not quick else [4],
                                 [1, 2, 3, 4] if not quick else [3])
    else:
        grid = itertools.product([64, 128], [32, 64, 128] if not quick else [64],
                                 [4, 8], [1, 2, 3] if not quick else [3])
    return [{"rows": r, "tile_n": n, "num_warps": w, "num_stages": s} for r, n, w, s in grid]


def make_inputs(shape: Shape, context: int | None = None) -> dict[str, Any]:
    """Random paged inputs of `shape` (with `context` keys per request, when given, in a
    block table as wide as the full shape's, so the kernel is specialized the same)."""
    context = shape.context if context is None else context
    query_len = min(shape.query_len, context)
    table_width = shape.context // BLOCK_SIZE
    num_blocks = 1 + shape.num_seqs * (-(-context // BLOCK_SIZE))
    cache = torch.randn(num_blocks, 1, 2, BLOCK_SIZE, shape.num_kv_heads, shape.head_size,
                        device=DEVICE, dtype=DTYPE)
    table = torch.zeros(shape.num_seqs, table_width, device=DEVICE, dtype=torch.int32)
    used = -(-context // BLOCK_SIZE)
    ids = torch.randperm(num_blocks - 1, device=DEVICE)[: shape.num_seqs * used] + 1
    table[:, :used] = ids.view(shape.num_seqs, used).to(torch.int32)
    num_tokens = shape.num_seqs * query_len
    return {
        "query": torch.randn(num_tokens, shape.num_heads, shape.head_size, device=DEVICE,
                             dtype=DTYPE),
        "key_cache": cache[:, 0, 0],
        "value_cache": cache[:, 0, 1],
        "query_start_loc": torch.arange(0, num_tokens + 1, query_len, device=DEVICE,
                                        dtype=torch.int32),
        "seq_lens": torch.full((shape.num_seqs,), context, device=DEVICE, dtype=torch.int32),
        "block_table": table,
        "max_query_len": query_len,
    }


def launcher(inputs: dict[str, Any], config: dict[str, int] | None, splits: int,
             out: torch.Tensor) -> Callable[[], None]:
    from kvferry.engine.attention.triton._attention_launch import TileConfig
    from kvferry.engine.attention.triton.unified_attention import launch_kernel

    tile = TileConfig(**config) if config is not None else None
    q = inputs["query"]
    args = (q, (inputs["key_cache"], inputs["value_cache"]), inputs["query_start_loc"],
            inputs["seq_lens"], inputs["block_table"], q.shape[-1] ** -0.5, True,
            inputs["max_query_len"], splits, out)
    return lambda: launch_kernel(*args, config=tile)


def specialization(shape: Shape, splits: int) -> tuple[Any, ...]:
    """What makes Triton compile a shape's launch separately (one request is specialized)."""
    return shape.kind, shape.head_size, shape.num_seqs == 1, splits > 1


def _compile(jobs: list[tuple[Shape, dict[str, int], int]],
             device: str = "cuda") -> list[tuple[Any, ...]]:
    """Worker: launches each job once on small inputs of its shape (same specialization), so
    Triton's shared cache holds the binary; returns (specialization, config, error) of each
    that failed."""
    global DEVICE
    DEVICE = device
    failed = []
    for shape, config, splits in jobs:
        try:
            inputs = make_inputs(shape, context=min(64, shape.context))
            launcher(inputs, config, splits, torch.empty_like(inputs["query"]))()
            synchronize()
        except Exception as exc:  # noqa: BLE001 - a candidate that does not compile is left out
            failed.append((specialization(shape, splits), tuple(sorted(config.items())),
                           f"{type(exc).__name__}: {str(exc)[:200]}"))
    return failed


def precompile(jobs: list[tuple[Shape, dict[str, int], int]],
               workers: int) -> list[tuple[Any, ...]]:
    """Compiles each job whose specialization and config no earlier job shares."""
    unique: dict[tuple[Any, ...], tuple[Shape, dict[str, int], int]] = {}
    for shape, config, splits in jobs:
        unique.setdefault((specialization(shape, splits), tuple(sorted(config.items()))),
                          (shape, config, splits))
    todo = list(unique.values())
    if workers <= 1 or len(todo) <= 1:
        return _compile(todo, DEVICE)
    chunks = [todo[i::workers] for i in range(workers)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        results = pool.map(_compile, chunks, [DEVICE] * len(chunks))
        return [f for failed in results for f in failed]


def reference(shape: Shape, inputs: dict[str, Any]) -> torch.Tensor:
    """SDPA over the request's keys gathered contiguous: (num_tokens, heads, head_size)."""
    n, ctx, qlen = shape.num_seqs, shape.context, shape.query_len
    blocks = inputs["block_table"][:, : ctx // BLOCK_SIZE].long()
    k = inputs["key_cache"][blocks].reshape(n, ctx, shape.num_kv_heads, shape.head_size)
    v = inputs["value_cache"][blocks].reshape(n, ctx, shape.num_kv_heads, shape.head_size)
    q = inputs["query"].view(n, qlen, shape.num_heads, shape.head_size).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), is_causal=qlen > 1, enable_gqa=True)
    return out.transpose(1, 2).reshape(n * qlen, shape.num_heads, shape.head_size)


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], None], repeats: int) -> float:
    """Median milliseconds of `fn` (kernels.py's CUDA-event timing); on the CPU (--smoke),
    the mean over `repeats` runs."""
    if DEVICE == "cuda":
        return kernels.time_ms(fn, repeats)
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) * 1e3 / repeats


def ragged_check(shape: Shape, inputs: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
    """Decode inputs with each request's context cut by 0-40 keys, and their reference: the
    last key tile is then partial (masked), which the timed shapes, multiples of every
    tile, never have."""
    from kvferry.engine.attention.triton.unified_attention import unified_attention_reference

    gen = torch.Generator().manual_seed(shape.context)
    cut = torch.randint(0, 41, (shape.num_seqs,), generator=gen)
    seq_lens = (inputs["seq_lens"].cpu() - cut).clamp_min(1).to(torch.int32).to(DEVICE)
    ragged = {**inputs, "seq_lens": seq_lens}
    q = inputs["query"]
    ref = unified_attention_reference(
        q, inputs["key_cache"], inputs["value_cache"], inputs["query_start_loc"], seq_lens,
        inputs["block_table"], q.shape[-1] ** -0.5)
    return ragged, ref


def measure(checks: list[tuple[dict[str, Any], torch.Tensor]], config: dict[str, int] | None,
            splits: int, repeats: int) -> float | str:
    """Milliseconds of one candidate on the first check's inputs, once its output matched
    every check's reference; else why it was refused."""
    try:
        for inputs, ref in checks:
            out = torch.empty_like(inputs["query"])
            run = launcher(inputs, config, splits, out)
            out.fill_(float("nan"))
            run()
            synchronize()
            error = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            if not error <= MAX_REL_ERROR:  # NaN (an unwritten row) fails too
                return f"relative error {error:.3g}"
        inputs = checks[0][0]
        return time_ms(launcher(inputs, config, splits, torch.empty_like(inputs["query"])),
                       repeats)
    except Exception as exc:  # noqa: BLE001 - a candidate that fails is refused, not fatal
        return f"{type(exc).__name__}: {str(exc)[:120]}"


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="attention_tuning.json", help="tuning table to write")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="stop trying candidates after this many seconds (best so far wins)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1))
    parser.add_argument("--quick", action="store_true", help="one candidate per kind")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the script)")
    args = parser.parse_args()
    shapes = SHAPES
    if args.smoke:
        DEVICE, shapes, args.repeats = "cpu", SMOKE_SHAPES, 1
        args.workers = min(args.workers, 2)
    elif not torch.cuda.is_available():
        print("benchmarks/attention_tuning.py measures a GPU kernel; no CUDA device here")
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    started = time.monotonic()
    torch.manual_seed(0)
    from kvferry.engine.attention.triton._attention_launch import (
        BUILT_IN,
        AttentionTuning,
        TileConfig,
    )

    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    per_kind = {kind: candidates(kind, args.quick or args.smoke) for kind in ("decode", "prefill")}
    jobs = [(shape, config, 1) for shape in shapes for config in per_kind[shape.kind]]
    failed = precompile(jobs, args.workers)
    broken = {(spec, config) for spec, config, _ in failed}
    print(f"{device}: compiled candidates in {time.monotonic() - started:.0f} s "
          f"({len(failed)} failed)", flush=True)
    for _, config, error in failed[:10]:
        print(f"  compile failed: {dict(config)}: {error}")

    results: dict[str, dict[str, Any]] = {}
    data: dict[Shape, list[tuple[dict[str, Any], torch.Tensor]]] = {}
    out_of_time = False
    for shape in shapes:
        inputs = make_inputs(shape)
        checks = [(inputs, reference(shape, inputs))]
        if shape.kind == "decode":
            checks.append(ragged_check(shape, inputs))
        built_in = measure(checks, None, 1, args.repeats)
        row: dict[str, Any] = {"built_in_ms": built_in, "candidates": []}
        for config in per_kind[shape.kind]:
            if time.monotonic() - started > args.budget_s:
                out_of_time = True
                break
            if (specialization(shape, 1), tuple(sorted(config.items()))) in broken:
                result: float | str = "did not compile"
            else:
                result = measure(checks, config, 1, args.repeats)
            row["candidates"].append((config, result))
        results[shape.name] = row
        print(f"{shape.name}: built-in {fmt(built_in)} ms, {len(row['candidates'])} "
              f"candidates", flush=True)
        if shape.kind == "decode":
            data[shape] = checks  # kept for the split pass
        else:
            del inputs, checks
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    tables: dict[str, dict[int, TileConfig]] = {"decode": {}, "prefill": {}}
    for kind, head_size in {(shape.kind, shape.head_size) for shape in shapes}:
        winner = pick_winner([results[shape.name]["candidates"] for shape in shapes
                              if (shape.kind, shape.head_size) == (kind, head_size)
                              and shape.name in results])
        if winner is not None:
            tables[kind][head_size] = TileConfig(**winner)

    # Split-KV with each decode winner: programs x splits where it paid (>= 3% faster).
    target_programs = BUILT_IN.target_programs
    for shape, checks in data.items():
        winner = tables["decode"].get(shape.head_size)
        if winner is None or time.monotonic() - started > args.budget_s + 30:
            continue
        config = asdict(winner)
        best_split, best_ms = 1, measure(checks, config, 1, args.repeats)
        split_ms: dict[int, float | str] = {1: best_ms}
        for splits in SPLITS:
            split_ms[splits] = ms = measure(checks, config, splits, args.repeats)
            if isinstance(ms, float) and isinstance(best_ms, float) and ms < 0.97 * best_ms:
                best_split, best_ms = splits, ms
        results[shape.name].update(split_ms=split_ms, best_split=best_split, tuned_ms=best_ms)
        if best_split > 1:
            target_programs = max(target_programs,
                                  shape.num_seqs * shape.num_kv_heads * best_split)
    data.clear()

    tuning = AttentionTuning(tables["decode"], tables["prefill"], target_programs,
                             BUILT_IN.min_keys_per_split, source=args.out)
    table = tuning.to_dict()
    table["measured_on"] = device
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)

    figures: dict[str, Any] = {"device": device, "tuning": table, "out_of_time": out_of_time,
                               "seconds": round(time.monotonic() - started, 1)}
    for shape in shapes:
        row = results.get(shape.name)
        if row is None:
            continue
        winner = tables[shape.kind].get(shape.head_size)
        tuned = row.get("tuned_ms", next(
            (ms for config, ms in row["candidates"]
             if winner is not None and config == asdict(winner)), None))
        built_in = row["built_in_ms"]
        entry: dict[str, Any] = {"built_in_ms": rounded(built_in), "tuned_ms": rounded(tuned),
                                 "config": asdict(winner) if winner else None}
        if shape.kind == "decode":
            entry["best_split"] = row.get("best_split")
            entry["split_ms"] = {str(k): rounded(v) for k, v in row.get("split_ms", {}).items()}
            for label, ms in (("built_in_tb_s", built_in), ("tuned_tb_s", tuned)):
                if isinstance(ms, float):
                    entry[label] = round(shape.kv_bytes() / (ms / 1e3) / 1e12, 3)
        entry["refused"] = [f"{c}: {r}" for c, r in row["candidates"] if isinstance(r, str)][:5]
        ranked = sorted((ms, c) for c, ms in row["candidates"] if isinstance(ms, float))
        entry["top"] = [[round(ms, 4), c] for ms, c in ranked[:3]]
        figures[shape.name] = entry
        print(f"{shape.name:28s} built-in {fmt(built_in)} ms -> tuned {fmt(tuned)} ms "
              f"{entry['config']} split {entry.get('best_split', '-')}")
    print(json.dumps(figures))
    sys.stdout.flush()


def pick_winner(rows: list[list[tuple[dict[str, int], float | str]]]) -> dict[str, int] | None:
    """The candidate of least total time over the shapes whose every candidate was tried
    (or, where the budget cut all short, over the most complete one); refused ones never win."""
    if not rows:
        return None
    longest = max(len(row) for row in rows)
    rows = [row for row in rows if len(row) == longest]
    totals: list[float] = [0.0] * longest
    for row in rows:
        for index, (_, ms) in enumerate(row):
            totals[index] += ms if isinstance(ms, float) else float("inf")
    best = min(range(longest), key=totals.__getitem__, default=None)
    if best is None or totals[best] == float("inf"):
        return None
    return rows[0][best][0]


def rounded(ms: Any) -> Any:
    return round(ms, 4) if isinstance(ms, float) else ms


def fmt(ms: Any) -> str:
    return f"{ms:.4f}" if isinstance(ms, float) else str(ms)


if __name__ == "__main__":
    main()
