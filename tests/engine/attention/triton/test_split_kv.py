"""Split-KV reduction kernel against its torch reference (attention with and without
splits is compared in test_unified_attention.py)."""

from __future__ import annotations

import pytest
import torch
from kvferry.engine.attention.triton.split_kv import (
    allocate_partials,
    reduce_kv_splits,
    reduce_kv_splits_reference,
)


def _partials(
    num_tokens: int, num_heads: int, num_splits: int, head_size: int, device: str, seed: int
):
    """Random partial results; some (token, head) splits saw no key (max -inf, sum 0)."""
    gen = torch.Generator().manual_seed(seed)
    block_d = 1 << (head_size - 1).bit_length()
    partial_out, partial_max, partial_sum = allocate_partials(
        num_tokens, num_heads, num_splits, block_d, torch.device(device)
    )
    shape = (num_tokens, num_heads, num_splits)
    partial_out.copy_(torch.randn(*shape, block_d, generator=gen))
    partial_max.copy_(4 * torch.randn(shape, generator=gen))
    partial_sum.copy_(torch.rand(shape, generator=gen) + 0.5)
    empty = torch.rand(shape, generator=gen) < 0.3
    empty[:, :, 0] = False  # every row saw at least one key somewhere
    partial_max[empty.to(device)] = float("-inf")
    partial_sum[empty.to(device)] = 0.0
    partial_out[empty.to(device)] = 0.0
    return partial_out, partial_max, partial_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_splits", "head_size"), [(3, 80), (16, 16), (1, 32)])
def test_matches_reference(device, dtype, num_splits, head_size, assert_close) -> None:
    partials = _partials(5, 6, num_splits, head_size, device, seed=num_splits)
    out = torch.full((5, 6, head_size), float("nan"), dtype=dtype, device=device)
    reduce_kv_splits(*partials, out)
    assert_close(out, reduce_kv_splits_reference(*partials, head_size), dtype)


def test_rejects_partials_that_do_not_fit(device) -> None:
    partials = _partials(2, 2, 2, 32, device, seed=0)
    out = torch.full((2, 2, 64), float("nan"), device=device)
    with pytest.raises(ValueError, match="does not fit"):
        reduce_kv_splits(*partials, out)
    with pytest.raises(ValueError, match="must be contiguous float32"):
        reduce_kv_splits(partials[0].half(), *partials[1:], out[..., :32])
    with pytest.raises(ValueError, match=r"partial_sum \(2, 2, 1\) must be \(2, 2, 2\)"):
        reduce_kv_splits(partials[0], partials[1], partials[2][..., :1], out[..., :32])
    assert out.isnan().all()
