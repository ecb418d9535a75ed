"""Encoder self-attention: non-causal attention of each request over its own keys, read
in place from the step's key and value tensors; nothing is cached.

It runs the unified attention kernel in its KV_FROM_BATCH mode (see `unified_attention`):
the (num_tokens, num_kv_heads, head_size) keys are handed over as a cache of one-slot
blocks, and request `i`'s program reads key `k` at row `query_start_loc[i] + k` with no
block table. So the kernel's tiling, online softmax, GQA grouping and split-KV apply
unchanged, memory stays linear in the tokens (no score matrix), and the decoder's paged
launch compiles exactly as before (the mode is a constexpr).
"""

from __future__ import annotations

from itertools import pairwise

import torch
from kvferry.engine.attention.triton._attention_inputs import check_encoder_inputs
from kvferry.engine.attention.triton._runtime import require_triton
from kvferry.engine.attention.triton.split_kv import choose_num_kv_splits
from kvferry.engine.attention.triton.unified_attention import (
    launch_kernel,
    launch_tuning,
    prepare_output,
    split_policy,
)


def encoder_attention(
    query: torch.Tensor,  # (num_tokens, num_heads, head_size)
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32
    scale: float,
    *,
    max_query_len: int | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,  # (num_tokens, num_heads, head_size)
) -> torch.Tensor:  # (num_tokens, num_heads, head_size)
    """Query rows `query_start_loc[i]:query_start_loc[i + 1]` attend, without a causal
    mask, over exactly the key and value rows of the same range.

    `query` holds exactly the batch's tokens (`query_start_loc[-1] == num_tokens`); query
    head `h` reads kv head `h // (num_heads // num_kv_heads)`. `key` and `value` may be
    strided views (of a fused projection, say) as long as head_size is contiguous.
    `max_query_len` only plans the launch (pass it to avoid a device sync);
    `num_kv_splits` as for `unified_attention`. Raises ValueError before launch on
    unsupported shapes, dtypes or layouts.
    """
    require_triton()
    check_encoder_inputs(query, key, value, query_start_loc, out)
    out = prepare_output(
        query, out, num_kv_splits, key=key, value=value, query_start_loc=query_start_loc
    )
    num_seqs = query_start_loc.shape[0] - 1
    if query.shape[0] == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    tuning = launch_tuning(query)
    if num_kv_splits is None:
        # Keys per request are its queries: only batches of short inputs could split.
        num_kv_splits = choose_num_kv_splits(num_seqs, key.shape[1], max_query_len, max_query_len,
                                             **split_policy(tuning))
    # (num_tokens, 1, num_kv_heads, head_size): token t is block t of one slot.
    kv = (key.unsqueeze(1), value.unsqueeze(1))
    launch_kernel(
        query, kv, query_start_loc, None, None, scale, False, max_query_len, num_kv_splits, out,
        tuning=tuning,
    )
    return out


def encoder_attention_reference(
    query: torch.Tensor,  # (num_tokens, num_heads, head_size)
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    query_start_loc: torch.Tensor,  # (num_seqs + 1,)
    scale: float,
) -> torch.Tensor:  # (num_tokens, num_heads, head_size)
    """Plain-torch `encoder_attention`: per request, dense attention over its own rows.

    Computes in float32 (float64 for float64 inputs) and returns the query's dtype.
    """
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = torch.empty_like(query)
    group = query.shape[1] // key.shape[1]
    starts = query_start_loc.tolist()
    for start, end in pairwise(starts):
        q = query[start:end].to(compute)  # (n, num_heads, head_size)
        k = key[start:end].to(compute).repeat_interleave(group, dim=1)
        v = value[start:end].to(compute).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # (num_heads, n, n)
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out
