"""KV write kernel against its reference and the torch backend's `write_kv_to_cache`, into
strided per-layer views of the engine's blocks-outermost cache tensor."""

from __future__ import annotations

import pytest
import torch
from kvferry.engine.attention.torch_backend import write_kv_to_cache
from kvferry.engine.attention.triton.reshape_and_cache import (
    reshape_and_cache,
    reshape_and_cache_reference,
)

NUM_BLOCKS, NUM_LAYERS, LAYER = 12, 3, 1


def _cache(
    block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, device: str
) -> torch.Tensor:
    """[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size], all NaN: any
    slot the kernel does not write stays NaN."""
    shape = (NUM_BLOCKS, NUM_LAYERS, 2, block_size, num_kv_heads, head_size)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _slots(num_tokens: int, block_size: int, num_padding: int, seed: int) -> torch.Tensor:
    """Distinct slots spread over random blocks (crossing block boundaries), with
    `num_padding` of them replaced by -1."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[:num_tokens]
    padding = torch.randperm(num_tokens, generator=gen)[:num_padding]
    slots[padding] = -1
    return slots


CASES = [
    # (num_tokens, block_size, num_kv_heads, head_size, dtype, num_padding)
    (9, 4, 2, 16, torch.float32, 0),
    (13, 4, 3, 80, torch.bfloat16, 3),
    (20, 8, 1, 128, torch.float16, 5),
    (6, 16, 8, 32, torch.float32, 2),
]


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "num_kv_heads", "head_size", "dtype", "num_padding"), CASES
)
def test_writes_every_slot_and_nothing_else(
    device, num_tokens, block_size, num_kv_heads, head_size, dtype, num_padding
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    # Keys as a view of a fused projection: a token stride wider than the heads.
    kv = torch.randn(num_tokens, 3 * num_kv_heads, head_size, generator=gen).to(device, dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads : 2 * num_kv_heads]
    slots = _slots(num_tokens, block_size, num_padding, seed=num_tokens).to(device)
    cache = _cache(block_size, num_kv_heads, head_size, dtype, device)
    expected = cache.clone()
    reshape_and_cache(key, value, cache[:, LAYER, 0], cache[:, LAYER, 1], slots)
    reshape_and_cache_reference(key, value, expected[:, LAYER, 0], expected[:, LAYER, 1], slots)
    # Copies are exact, and NaN == NaN here: untouched slots (other layers, padding) match.
    assert torch.equal(cache.isnan(), expected.isnan())
    assert torch.equal(cache.nan_to_num(), expected.nan_to_num())
    written = int((~cache.isnan()).sum())
    assert written == 2 * (num_tokens - num_padding) * num_kv_heads * head_size


def test_matches_the_torch_backends_write(device) -> None:
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(10, 2, 32, generator=gen).to(device)
    value = torch.randn(10, 2, 32, generator=gen).to(device)
    slots = _slots(10, 4, 0, seed=7).to(device)
    cache = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, 4, 2, 32, generator=gen).to(device)
    expected = cache.clone()
    reshape_and_cache(key, value, cache[:, LAYER, 0], cache[:, LAYER, 1], slots)
    write_kv_to_cache(key, value, (expected[:, LAYER, 0], expected[:, LAYER, 1]), slots)
    assert torch.equal(cache, expected)


def test_rejects_unsupported_inputs_before_launch(device) -> None:
    cache = _cache(4, 2, 16, torch.float32, device)
    key_cache, value_cache = cache[:, LAYER, 0], cache[:, LAYER, 1]
    key = torch.randn(3, 2, 16, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="key has dtype torch.float16, expected torch.float32"):
        reshape_and_cache(key.half(), key.half(), key_cache, value_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        reshape_and_cache(key, key, key_cache, value_cache, slots.float())
    with pytest.raises(ValueError, match="one slot per token"):
        reshape_and_cache(key, key, key_cache, value_cache, slots[:2])
    # head_size strided, num_kv_heads contiguous: a layout the kernels do not know.
    transposed = cache.transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        reshape_and_cache(key, key, transposed[:, LAYER, 0], transposed[:, LAYER, 1], slots)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        reshape_and_cache(key, key, key_cache, value_cache, slots.to("meta"))
    assert cache.isnan().all(), "a rejected call wrote to the cache"
