"""RMSNorm kernel (plain and fused with the residual add) against its reference and the
engine's `RMSNorm` layer."""

from __future__ import annotations

import pytest
import torch
from kvferry.engine.attention.triton.rmsnorm import (
    fused_add_rms_norm,
    rms_norm,
    rms_norm_reference,
)
from kvferry.engine.layers.rmsnorm import RMSNorm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=gen)).to(device, dtype)
    residual = torch.randn(shape, generator=gen).to(device, dtype)
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(device, dtype)
    return x, residual, weight


def _layer(weight: torch.Tensor) -> RMSNorm:
    layer = RMSNorm(weight.shape[0], EPS, dtype=weight.dtype).to(weight.device)
    layer.weight.data.copy_(weight)
    return layer


def _poisoned(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


# (9, 80): a hidden size that is not a power of two; (2, 3, 64): per-head norms (q/k norm).
SHAPES = pytest.mark.parametrize("shape", [(9, 80), (2, 3, 64)], ids=["80", "heads-64"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SHAPES
def test_rms_norm_matches_reference_and_layer(device, dtype, shape, assert_close) -> None:
    x, _, weight = _inputs(shape, dtype, device, seed=1)
    out = _poisoned(x)
    assert rms_norm(x, weight, EPS, out=out).data_ptr() == out.data_ptr()
    expected, _ = rms_norm_reference(x, weight, EPS)
    assert_close(out, expected, dtype)
    assert_close(out, _layer(weight)(x), dtype, "against the engine's layer")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SHAPES
def test_fused_add_matches_reference_and_layer(device, dtype, shape, assert_close) -> None:
    x, residual, weight = _inputs(shape, dtype, device, seed=2)
    out, residual_out = _poisoned(x), _poisoned(x)
    fused_add_rms_norm(x, residual, weight, EPS, out=out, residual_out=residual_out)
    expected, expected_residual = rms_norm_reference(x, weight, EPS, residual)
    assert_close(out, expected, dtype)
    assert_close(residual_out, expected_residual, dtype, "new residual")
    layer_out, layer_residual = _layer(weight).add_and_norm(x, residual)
    assert_close(out, layer_out, dtype, "against the engine's layer")
    assert_close(residual_out, layer_residual, dtype, "new residual against the layer")


def test_float32_residual_is_exact_and_norm_within_rounding(device) -> None:
    # The same float32 arithmetic: only rsqrt and summation order may differ.
    x, residual, weight = _inputs((5, 96), torch.float32, device, seed=3)
    out, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    layer_out, layer_residual = _layer(weight).add_and_norm(x, residual)
    torch.testing.assert_close(new_residual, layer_residual, rtol=0, atol=0)
    torch.testing.assert_close(out, layer_out, rtol=1e-6, atol=1e-6)


def test_rejects_unsupported_inputs_before_launch(device) -> None:
    x, residual, weight = _inputs((4, 32), torch.float32, device, seed=4)
    with pytest.raises(ValueError, match="dtype torch.float16, expected torch.float32"):
        rms_norm(x, weight.half(), EPS)
    with pytest.raises(ValueError, match="last dimension 32, weight has 16"):
        rms_norm(x, weight[:16], EPS)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, residual[:2], weight, EPS)
    with pytest.raises(ValueError, match="dtype torch.float64"):
        rms_norm(x.double(), weight.double(), EPS)
