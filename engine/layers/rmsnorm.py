"""Root-mean-square layer norm, optionally fused with the residual add before it."""

from __future__ import annotations

import torch
from kvferry.engine.attention.triton.rmsnorm import fused_add_rms_norm, rms_norm
from torch import nn


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, computed in float32 like the reference.

    `add_and_norm` is the pre-norm decoder layer's residual step in one call: it adds
    the residual, normalizes the sum, and returns the sum as the next residual. With
    `triton_kernels` set (see `kvferry.engine.layers.kernels`) each is one Triton launch
    instead of about six PyTorch ones.
    """

    triton_kernels = False

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., hidden_size); the reduction runs in float32 whatever the model dtype,
        # and the result is cast back before the weight multiply, as HF does.
        x32 = x.float()
        variance = x32.pow(2).mean(dim=-1, keepdim=True)  # (..., 1)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., hidden_size) -> (..., hidden_size)
        if self.triton_kernels:
            return rms_norm(x, self.weight, self.eps)
        return self._norm(x)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(norm(x + residual), x + residual)`."""
        if self.triton_kernels:
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual  # (num_tokens, hidden_size)
        return self._norm(x), x
