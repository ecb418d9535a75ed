"""Rotary position embedding applied in place to queries and keys, one program per token.

The cos/sin tables are `(max_positions, rot_dim // 2)`, as
`kvferry.engine.layers.rotary.RotaryEmbedding` builds them (any rope scaling, Llama 3's
included, is already in them). The first `rot_dim` dims of each head rotate; the rest, if
any, stay as they are. Two layouts pair the dims differently:

- NeoX (rotate-half, Llama's): dim `i` pairs with `i + rot_dim // 2`;
- GPT-J (interleaved): dim `2 * i` pairs with `2 * i + 1`.
"""

from __future__ import annotations

import torch
from kvferry.engine.attention.triton._runtime import (
    check_device,
    check_dtype,
    check_index_dtype,
    next_power_of_2,
    require_triton,
    tl,
    triton,
)


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_token,
    stride_head,
    num_heads,
    token,
    cos,
    sin,
    half,
    IS_NEOX: tl.constexpr,
    ROUND_EACH_OP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # cos, sin: (1, BLOCK_R) float32, the angles of this token's position.
    heads = tl.arange(0, BLOCK_H)[:, None]  # (BLOCK_H, 1)
    pairs = tl.arange(0, BLOCK_R)[None, :]  # (1, BLOCK_R)
    mask = (heads < num_heads) & (pairs < half)
    if IS_NEOX:
        first, second = pairs, pairs + half
    else:
        first, second = 2 * pairs, 2 * pairs + 1
    base = x_ptr + token * stride_token + heads * stride_head
    x1 = tl.load(base + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + second, mask=mask, other=0.0).to(tl.float32)
    if ROUND_EACH_OP:
        # Each product rounded to the storage dtype before the sum, as eager PyTorch (and
        # HF's models) compute rope in half precision.
        dtype = x_ptr.dtype.element_ty
        r1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
        r2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    else:
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
    tl.store(base + first, r1, mask=mask)
    tl.store(base + second, r2, mask=mask)


@triton.jit
def _rotary_kernel(
    # pointers
    query_ptr,
    key_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    # sizes
    num_heads,
    num_kv_heads,
    half,  # rot_dim // 2: the number of rotated pairs per head
    # strides
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cos,
    stride_sin,
    # constexpr flags
    IS_NEOX: tl.constexpr,
    ROUND_EACH_OP: tl.constexpr,
    BLOCK_HQ: tl.constexpr,  # num_heads rounded up to a power of two
    BLOCK_HK: tl.constexpr,  # num_kv_heads rounded up to a power of two
    BLOCK_R: tl.constexpr,  # half rounded up to a power of two
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, BLOCK_R)[None, :]  # (1, BLOCK_R)
    cos = tl.load(cos_ptr + position * stride_cos + pairs, mask=pairs < half, other=0.0)
    sin = tl.load(sin_ptr + position * stride_sin + pairs, mask=pairs < half, other=0.0)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    _rotate_heads(
        query_ptr,
        stride_q_token,
        stride_q_head,
        num_heads,
        token,
        cos,
        sin,
        half,
        IS_NEOX,
        ROUND_EACH_OP,
        BLOCK_HQ,
        BLOCK_R,
    )
    _rotate_heads(
        key_ptr,
        stride_k_token,
        stride_k_head,
        num_kv_heads,
        token,
        cos,
        sin,
        half,
        IS_NEOX,
        ROUND_EACH_OP,
        BLOCK_HK,
        BLOCK_R,
    )


def _check_inputs(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    if query.dim() != 3 or key.dim() != 3 or query.shape[::2] != key.shape[::2]:
        raise ValueError(
            "query and key must be (num_tokens, num_heads, head_size) and (num_tokens, "
            f"num_kv_heads, head_size), got {tuple(query.shape)} and {tuple(key.shape)}"
        )
    if positions.shape != (query.shape[0],):
        raise ValueError(f"positions must be ({query.shape[0]},), got {tuple(positions.shape)}")
    check_index_dtype("positions", positions)
    if cos_cache.dim() != 2 or cos_cache.shape != sin_cache.shape:
        raise ValueError(
            "cos_cache and sin_cache must both be (max_positions, rot_dim // 2), got "
            f"{tuple(cos_cache.shape)} and {tuple(sin_cache.shape)}"
        )
    if 2 * cos_cache.shape[1] > query.shape[2]:
        raise ValueError(f"rot_dim {2 * cos_cache.shape[1]} exceeds head_size {query.shape[2]}")
    check_dtype("query", query)
    check_dtype("key", key, query.dtype)
    check_dtype("cos_cache", cos_cache)
    check_dtype("sin_cache", sin_cache, cos_cache.dtype)
    named = (("query", query), ("key", key), ("cos_cache", cos_cache), ("sin_cache", sin_cache))
    for name, tensor in named:
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")


def rotary_embedding(
    positions: torch.Tensor,  # (num_tokens,) int64
    query: torch.Tensor,  # (num_tokens, num_heads, head_size), rotated in place
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_size), rotated in place
    cos_cache: torch.Tensor,  # (max_positions, rot_dim // 2)
    sin_cache: torch.Tensor,  # (max_positions, rot_dim // 2)
    is_neox: bool = True,
    round_each_op: bool = False,
) -> None:
    """Rotates the first `rot_dim` dims of every query and key head by its token's angle.

    Arithmetic runs in float32; results are rounded once to the tensors' dtype, or with
    `round_each_op` after each product and sum, as eager PyTorch computes rope in the
    tensors' dtype (the models' path: their outputs then equal the torch backend's and
    HF's bit for bit). Positions must lie in `[0, max_positions)` (they are not
    bounds-checked on the device).
    """
    require_triton()
    _check_inputs(positions, query, key, cos_cache, sin_cache)
    check_device(
        _rotary_kernel,
        positions=positions,
        query=query,
        key=key,
        cos_cache=cos_cache,
        sin_cache=sin_cache,
    )
    num_tokens, num_heads, _ = query.shape
    num_kv_heads, half = key.shape[1], cos_cache.shape[1]
    if num_tokens == 0 or half == 0:
        return
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        positions,
        cos_cache,
        sin_cache,
        num_heads,
        num_kv_heads,
        half,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        IS_NEOX=is_neox,
        ROUND_EACH_OP=round_each_op,
        BLOCK_HQ=next_power_of_2(num_heads),
        BLOCK_HK=next_power_of_2(num_kv_heads),
        BLOCK_R=next_power_of_2(half),
    )


def _rotate_reference(
    x: torch.Tensor,  # (num_tokens, num_heads, head_size)
    cos: torch.Tensor,  # (num_tokens, 1, rot_dim // 2) float32
    sin: torch.Tensor,  # (num_tokens, 1, rot_dim // 2) float32
    is_neox: bool,
) -> torch.Tensor:
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half].float(), x[..., 2 * half :]
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin  # (num_tokens, num_heads, half) each
    if is_neox:
        rotated = torch.cat((r1, r2), dim=-1)
    else:
        rotated = torch.stack((r1, r2), dim=-1).flatten(-2)  # interleave back
    return torch.cat((rotated.to(x.dtype), rest), dim=-1)


def rotary_embedding_reference(
    positions: torch.Tensor,  # (num_tokens,)
    query: torch.Tensor,  # (num_tokens, num_heads, head_size)
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    cos_cache: torch.Tensor,  # (max_positions, rot_dim // 2)
    sin_cache: torch.Tensor,  # (max_positions, rot_dim // 2)
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `rotary_embedding`, returning rotated copies `(query, key)`."""
    cos = cos_cache[positions].float().unsqueeze(1)  # (num_tokens, 1, rot_dim // 2)
    sin = sin_cache[positions].float().unsqueeze(1)
    return _rotate_reference(query, cos, sin, is_neox), _rotate_reference(key, cos, sin, is_neox)
