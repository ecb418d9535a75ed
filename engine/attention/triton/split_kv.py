"""Split-KV (flash-decoding): when to split a launch, and the second step that combines
each query head's per-split partial results.

With split-KV, `unified_attention` cuts each request's keys into `num_splits` ranges and
attends over each range separately. A range leaves, per (token, query head), an
unnormalized output `acc` (the softmax numerator applied to the values), the running max
`m` of its scores (log2 units, scale applied) and the sum `l` of `exp2(score - m)`. The
exact softmax over all keys is then `sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s`
with `M = max_s m_s`; a range that saw no key has `m = -inf` and weight 0.
"""

from __future__ import annotations

import torch
from kvferry.engine.attention.triton._runtime import (
    cdiv,
    check_device,
    check_dtype,
    is_interpreted,
    next_power_of_2,
    require_triton,
    tl,
    triton,
)

# Split-KV heuristic: below this many (request, kv head) programs a launch leaves a GPU
# with about a hundred multiprocessors underused; each split gets at least
# MIN_KEYS_PER_SPLIT keys so the reduction stays cheap next to the attention itself.
TARGET_PROGRAMS = 128
MIN_KEYS_PER_SPLIT = 512
MAX_SPLITS = 16
# Split only launches whose queries fit one program per request (decode, short verify).
MAX_SPLIT_QUERY_LEN = 8


@triton.jit
def _reduce_kv_splits_kernel(
    # pointers
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    # sizes
    num_heads,
    head_size,
    num_splits,
    # strides
    stride_o_token,
    stride_o_head,
    # constexpr flags
    BLOCK_H: tl.constexpr,  # query heads per program
    BLOCK_S: tl.constexpr,  # num_splits rounded up to a power of two
    BLOCK_D: tl.constexpr,  # the partials' padded head size (a power of two)
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    head_valid = heads < num_heads
    valid = head_valid[:, None] & (splits[None, :] < num_splits)  # (BLOCK_H, BLOCK_S)
    part = (token * num_heads + heads[:, None]) * num_splits + splits[None, :]
    m = tl.load(partial_max_ptr + part, mask=valid, other=float("-inf"))
    l = tl.load(partial_sum_ptr + part, mask=valid, other=0.0)
    m_max = tl.max(m, axis=1)  # (BLOCK_H,)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)[:, None])
    total = tl.sum(l * weight, axis=1)  # (BLOCK_H,)
    acc = tl.load(
        partial_out_ptr + part[:, :, None] * BLOCK_D + dims[None, None, :],
        mask=valid[:, :, None],
        other=0.0,
    )  # (BLOCK_H, BLOCK_S, BLOCK_D)
    out = tl.sum(acc * weight[:, :, None], axis=1)  # (BLOCK_H, BLOCK_D)
    out = out / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(
        out_ptr + token * stride_o_token + heads[:, None] * stride_o_head + dims[None, :],
        out,
        mask=head_valid[:, None] & (dims[None, :] < head_size),
    )


def allocate_partials(
    num_tokens: int, num_heads: int, num_splits: int, block_d: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous float32 scratch `(partial_out, partial_max, partial_sum)`: each
    (num_tokens, num_heads, num_splits), `partial_out` with a last axis of `block_d`."""
    shape = (num_tokens, num_heads, num_splits)
    partial_out = torch.empty(*shape, block_d, dtype=torch.float32, device=device)
    partial_max = torch.empty(shape, dtype=torch.float32, device=device)
    return partial_out, partial_max, torch.empty_like(partial_max)


def reduce_kv_splits(
    partial_out: torch.Tensor,  # (num_tokens, num_heads, num_splits, block_d) float32
    partial_max: torch.Tensor,  # (num_tokens, num_heads, num_splits) float32
    partial_sum: torch.Tensor,  # (num_tokens, num_heads, num_splits) float32
    out: torch.Tensor,  # (num_tokens, num_heads, head_size), written
) -> torch.Tensor:
    """Combines the splits of every (token, head) into `out` and returns it."""
    require_triton()
    num_tokens, num_heads, num_splits, block_d = partial_out.shape
    expected = (num_tokens, num_heads, num_splits)
    if partial_max.shape != expected or partial_sum.shape != expected:
        raise ValueError(
            f"partial_max {tuple(partial_max.shape)} and partial_sum "
            f"{tuple(partial_sum.shape)} must be {expected}"
        )
    for name, t in (
        ("partial_out", partial_out),
        ("partial_max", partial_max),
        ("partial_sum", partial_sum),
    ):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32, from allocate_partials")
    check_dtype("out", out)
    if out.shape[:2] != (num_tokens, num_heads) or not 0 < out.shape[2] <= block_d:
        raise ValueError(f"out {tuple(out.shape)} does not fit partials {tuple(partial_out.shape)}")
    if out.stride(-1) != 1 or block_d != next_power_of_2(block_d):
        raise ValueError("out must be contiguous in its last dimension and block_d a power of 2")
    check_device(
        _reduce_kv_splits_kernel,
        partial_out=partial_out,
        partial_max=partial_max,
        partial_sum=partial_sum,
        out=out,
    )
    block_s = next_power_of_2(num_splits)
    if is_interpreted(_reduce_kv_splits_kernel):
        # The interpreter pays per program and operation: one program per token.
        block_h = next_power_of_2(num_heads)
    else:
        # About 4K partial floats per program keep its tile in registers.
        block_h = max(1, min(next_power_of_2(num_heads), 4096 // (block_s * block_d)))
    if num_tokens and num_heads:
        _reduce_kv_splits_kernel[(num_tokens, cdiv(num_heads, block_h))](
            out,
            partial_out,
            partial_max,
            partial_sum,
            num_heads,
            out.shape[2],
            num_splits,
            out.stride(0),
            out.stride(1),
            BLOCK_H=block_h,
            BLOCK_S=block_s,
            BLOCK_D=block_d,
        )
    return out


def reduce_kv_splits_reference(
    partial_out: torch.Tensor,  # (num_tokens, num_heads, num_splits, block_d) float32
    partial_max: torch.Tensor,  # (num_tokens, num_heads, num_splits) float32
    partial_sum: torch.Tensor,  # (num_tokens, num_heads, num_splits) float32
    head_size: int,
) -> torch.Tensor:  # (num_tokens, num_heads, head_size) float32
    """Plain-torch `reduce_kv_splits`."""
    m_max = partial_max.amax(dim=-1, keepdim=True)  # (num_tokens, num_heads, 1)
    m_max = torch.where(m_max == float("-inf"), torch.zeros_like(m_max), m_max)
    weight = torch.exp2(partial_max - m_max)  # (num_tokens, num_heads, num_splits)
    total = (partial_sum * weight).sum(dim=-1, keepdim=True)
    total = torch.where(total == 0, torch.ones_like(total), total)
    out = (partial_out[..., :head_size] * weight[..., None]).sum(dim=-2)
    return out / total


def choose_num_kv_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    *,
    target_programs: int = TARGET_PROGRAMS,
    min_keys_per_split: int = MIN_KEYS_PER_SPLIT,
) -> int:
    """How many key ranges to split each request into (1: no split-KV).

    Splits only short-query launches (decode) whose (request, kv head) programs are too few
    to fill the GPU, into as many ranges as bring the program count near `target_programs`
    while each range keeps at least `min_keys_per_split` keys (a GPU's tuning table may set
    both; see `_attention_launch`).
    """
    programs = max(num_seqs * num_kv_heads, 1)
    if max_query_len > MAX_SPLIT_QUERY_LEN or programs >= target_programs:
        return 1
    by_length = max_seq_len // min_keys_per_split
    return max(1, min(MAX_SPLITS, cdiv(target_programs, programs), by_length))
