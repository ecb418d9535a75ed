"""Layer norm with a learned scale and shift (BART, Whisper)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    """`weight * (x - mean(x)) / sqrt(var(x) + eps) + bias` over the last axis.

    The loader fills `weight` and `bias`; the arithmetic is `F.layer_norm`, as the
    reference's `nn.LayerNorm` does, in the model dtype.
    """

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., hidden_size) -> (..., hidden_size)
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)
