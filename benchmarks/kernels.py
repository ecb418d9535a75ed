"""GPU kernels against the memory roofline and against SDPA (one GPU, one run).

Every figure is read against a floor measured in the same run:

- decode attention (batch 64; contexts 1k, 4k, 16k; bf16; Llama-8B heads: 32 query heads,
  8 KV heads, head size 128; block size 16, blocks shuffled): bytes of K and V read over the
  kernel's time, as a fraction of the device-to-device copy bandwidth (bytes read plus
  written by `Tensor.copy_`);
- reshape_and_cache (65,536 tokens into that cache): bytes read plus written, likewise;
- prefill attention (one 8k-token sequence, and 16 x 1k) over the paged cache, against
  `scaled_dot_product_attention` on the same shapes with contiguous K and V: time ratio.

Targets: decode >= 0.8 of the copy bandwidth at 4k and 16k; prefill <= 1.3x SDPA's time.
Timing: CUDA events, a warm-up, the median of repeated runs, inputs random (never zeros).
The last line printed is one JSON object with the figures.

    python benchmarks/kernels.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
DECODE_BATCH = 64
DECODE_CONTEXTS = (1024, 4096, 16384)
PREFILL_SHAPES = {"1x8k": (1, 8192), "16x1k": (16, 1024)}


def time_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median milliseconds of `fn` over `repeats` runs, after three warm-up runs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(repeats: int) -> float:
    """Bytes per second a device-to-device copy moves (read plus written)."""
    src = torch.randn(256 * 2**20, device="cuda", dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def paged_cache(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One layer's K and V views of a blocks-outermost cache holding `num_tokens` slots."""
    num_blocks = 1 + num_tokens // BLOCK_SIZE  # block 0 is the null block
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size] with one layer.
    cache = torch.randn(num_blocks, 1, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE,
                        device="cuda", dtype=DTYPE)
    return cache[:, 0, 0], cache[:, 0, 1], num_blocks


def shuffled_block_table(num_seqs: int, blocks_per_seq: int, num_blocks: int) -> torch.Tensor:
    ids = torch.randperm(num_blocks - 1, device="cuda")[: num_seqs * blocks_per_seq] + 1
    return ids.view(num_seqs, blocks_per_seq).to(torch.int32)


def bench_decode(context: int, bandwidth: float, repeats: int) -> dict[str, float]:
    from kvferry.engine.attention.triton import unified_attention

    key_cache, value_cache, num_blocks = paged_cache(DECODE_BATCH * context)
    block_table = shuffled_block_table(DECODE_BATCH, context // BLOCK_SIZE, num_blocks)
    query = torch.randn(DECODE_BATCH, NUM_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE)
    query_start_loc = torch.arange(DECODE_BATCH + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((DECODE_BATCH,), context, device="cuda", dtype=torch.int32)
    out = torch.empty_like(query)
    ms = time_ms(lambda: unified_attention(
        query, key_cache, value_cache, query_start_loc, seq_lens, block_table,
        HEAD_SIZE**-0.5, max_query_len=1, max_seq_len=context, out=out), repeats)
    kv_bytes = 2 * DECODE_BATCH * context * NUM_KV_HEADS * HEAD_SIZE * key_cache.element_size()
    achieved = kv_bytes / (ms / 1e3)
    return {"ms": round(ms, 4), "tb_s": round(achieved / 1e12, 3),
            "bw_ratio": round(achieved / bandwidth, 3)}


def bench_reshape_and_cache(bandwidth: float, repeats: int) -> dict[str, float]:
    from kvferry.engine.attention.triton import reshape_and_cache

    num_tokens = 65536
    key_cache, value_cache, num_blocks = paged_cache(num_tokens)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE)
    value = torch.randn_like(key)
    slots = torch.randperm((num_blocks - 1) * BLOCK_SIZE, device="cuda")[:num_tokens] + BLOCK_SIZE
    ms = time_ms(lambda: reshape_and_cache(key, value, key_cache, value_cache, slots), repeats)
    moved = 2 * 2 * key.numel() * key.element_size()  # K and V, read and written
    achieved = moved / (ms / 1e3)
    return {"ms": round(ms, 4), "bw_ratio": round(achieved / bandwidth, 3)}


def bench_prefill(num_seqs: int, seq_len: int, repeats: int) -> dict[str, float]:
    from kvferry.engine.attention.triton import unified_attention

    key_cache, value_cache, num_blocks = paged_cache(num_seqs * seq_len)
    block_table = shuffled_block_table(num_seqs, seq_len // BLOCK_SIZE, num_blocks)
    num_tokens = num_seqs * seq_len
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE)
    query_start_loc = torch.arange(0, num_tokens + 1, seq_len, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), seq_len, device="cuda", dtype=torch.int32)
    out = torch.empty_like(query)
    ours = time_ms(lambda: unified_attention(
        query, key_cache, value_cache, query_start_loc, seq_lens, block_table,
        HEAD_SIZE**-0.5, max_query_len=seq_len, max_seq_len=seq_len, out=out), repeats)
    # SDPA on the same shapes, K and V contiguous: (num_seqs, heads, seq_len, head_size).
    q = query.view(num_seqs, seq_len, NUM_HEADS, HEAD_SIZE).transpose(1, 2)
    k = torch.randn(num_seqs, NUM_KV_HEADS, seq_len, HEAD_SIZE, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    sdpa = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True), repeats)
    return {"ms": round(ours, 4), "sdpa_ms": round(sdpa, 4), "vs_sdpa": round(ours / sdpa, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py measures GPU kernels; no CUDA device here")
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth(args.repeats)
    print(f"{device}: device copy {bandwidth / 1e12:.2f} TB/s (read + written)")
    from kvferry.engine.attention.triton._attention_launch import (
        attention_tuning,
        device_capability,
    )

    tuning = attention_tuning(device_capability(torch.device("cuda"))).source
    figures: dict[str, Any] = {"device": device, "copy_tb_s": round(bandwidth / 1e12, 3),
                               "tuning": tuning}
    for context in DECODE_CONTEXTS:
        decode = bench_decode(context, bandwidth, args.repeats)
        print(f"decode batch {DECODE_BATCH} x {context}: {decode}")
        figures[f"decode_{context // 1024}k"] = decode
        torch.cuda.empty_cache()
    cache_write = bench_reshape_and_cache(bandwidth, args.repeats)
    print(f"reshape_and_cache 65536 tokens: {cache_write}")
    figures["reshape_and_cache"] = cache_write
    for name, (num_seqs, seq_len) in PREFILL_SHAPES.items():
        prefill = bench_prefill(num_seqs, seq_len, args.repeats)
        print(f"prefill {name}: {prefill}")
        figures[f"prefill_{name}"] = prefill
    figures.update(
        decode_bw_ratio_4k=figures["decode_4k"]["bw_ratio"],
        decode_bw_ratio_16k=figures["decode_16k"]["bw_ratio"],
        prefill_vs_sdpa=max(figures[f"prefill_{n}"]["vs_sdpa"] for n in PREFILL_SHAPES),
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
