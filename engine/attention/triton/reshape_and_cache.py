"""Writes a step's new keys and values into one layer's paged KV cache at their slots.

Slot `s` is `(block, offset) = (s // block_size, s % block_size)`. The layer's key and
value caches are strided views of the engine's one cache tensor
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]`, so the kernel addresses
them through their four strides and never assumes the views are contiguous.
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
def _reshape_and_cache_kernel(
    # pointers
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    # sizes
    num_kv_heads,
    head_size,
    block_size,
    # strides
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_kc_block,
    stride_kc_offset,
    stride_kc_head,
    stride_vc_block,
    stride_vc_offset,
    stride_vc_head,
    # constexpr flags
    BLOCK_H: tl.constexpr,  # num_kv_heads rounded up to a power of two
    BLOCK_D: tl.constexpr,  # head_size rounded up to a power of two
):
    # One program per token copies all its heads: a (BLOCK_H, BLOCK_D) tile.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # a negative slot is padding: nothing to store
        block = slot // block_size
        offset = slot % block_size
        heads = tl.arange(0, BLOCK_H)[:, None]  # (BLOCK_H, 1)
        dims = tl.arange(0, BLOCK_D)[None, :]  # (1, BLOCK_D)
        mask = (heads < num_kv_heads) & (dims < head_size)
        k = tl.load(key_ptr + token * stride_k_token + heads * stride_k_head + dims, mask=mask)
        v = tl.load(value_ptr + token * stride_v_token + heads * stride_v_head + dims, mask=mask)
        kc_base = block * stride_kc_block + offset * stride_kc_offset
        vc_base = block * stride_vc_block + offset * stride_vc_offset
        tl.store(key_cache_ptr + kc_base + heads * stride_kc_head + dims, k, mask=mask)
        tl.store(value_cache_ptr + vc_base + heads * stride_vc_head + dims, v, mask=mask)


def _check_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be (num_tokens, num_kv_heads, head_size), got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be (num_blocks, block_size, num_kv_heads, "
            f"head_size), got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"keys of {tuple(key.shape[1:])} (num_kv_heads, head_size) do not fit a cache of "
            f"{tuple(key_cache.shape[2:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be ({key.shape[0]},), one slot per token, got "
            f"{tuple(slot_mapping.shape)}"
        )
    check_index_dtype("slot_mapping", slot_mapping)
    check_dtype("key_cache", key_cache)
    for name, tensor in (("key", key), ("value", value), ("value_cache", value_cache)):
        check_dtype(name, tensor, key_cache.dtype)
    for name, tensor in (("key", key), ("value", value)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.stride(-1) != 1:
            raise ValueError(
                f"{name} has strides {cache.stride()}: the kernels need head_size to be its "
                "contiguous last dimension"
            )


def reshape_and_cache(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size), strided
    value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size), strided
    slot_mapping: torch.Tensor,  # (num_tokens,) int64; negative: padding, skipped
) -> None:
    """Stores token `t`'s key and value at cache slot `slot_mapping[t]`, in place.

    Raises ValueError before launch when shapes, dtypes (keys, values and caches must
    share one of float32/float16/bfloat16) or the caches' layout are not supported.
    """
    require_triton()
    _check_inputs(key, value, key_cache, value_cache, slot_mapping)
    check_device(
        _reshape_and_cache_kernel,
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slot_mapping,
    )
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_kv_heads,
        head_size,
        key_cache.shape[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_size),
    )


def reshape_and_cache_reference(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    slot_mapping: torch.Tensor,  # (num_tokens,) int64
) -> None:
    """Plain-torch `reshape_and_cache`: the same writes, negative slots skipped."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0  # (num_tokens,)
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[keep].to(value_cache.dtype)
