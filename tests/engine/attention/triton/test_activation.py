"""SiLU-and-mul kernel against its torch reference and the engine's layer."""

from __future__ import annotations

import pytest
import torch
from kvferry.engine.attention.triton.activation import silu_and_mul, silu_and_mul_reference
from kvferry.engine.layers.activation import silu_and_mul as layer_silu_and_mul

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 2 * 80), (2, 3, 2 * 1100)], ids=["2d-80", "3d-1100"])
def test_matches_reference_and_layer(device, dtype, shape, assert_close) -> None:
    # 1100 columns take two programs per row (MAX_BLOCK 1024), the second one masked.
    gen = torch.Generator().manual_seed(sum(shape))
    gate_up = (2 * torch.randn(shape, generator=gen)).to(device, dtype)
    out = torch.full((*shape[:-1], shape[-1] // 2), float("nan"), dtype=dtype, device=device)
    result = silu_and_mul(gate_up, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert_close(out, silu_and_mul_reference(gate_up), dtype)
    assert_close(out, layer_silu_and_mul(gate_up), dtype, "against the engine's layer")


def test_reads_a_strided_input(device, assert_close) -> None:
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 3 * 64, generator=gen).to(device)
    gate_up = wide[:, :128]  # rows 192 apart: a view with a row stride of its own
    assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), torch.float32)


def test_rejects_unsupported_inputs_before_launch(device) -> None:
    with pytest.raises(ValueError, match="even last dimension"):
        silu_and_mul(torch.randn(4, 7, device=device))
    with pytest.raises(ValueError, match="dtype torch.float64"):
        silu_and_mul(torch.randn(4, 8, dtype=torch.float64, device=device))
    out = torch.full((4, 4), float("nan"), dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="out must be"):
        silu_and_mul(torch.randn(4, 8, device=device), out=out)
    assert out.isnan().all()
