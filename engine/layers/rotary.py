"""Rotary position embeddings (rotate-half layout) with the rope scalings Llama uses.

The cos/sin table is computed once for every position up to `max_position_embeddings`
and indexed by the flat batch's positions each step, so no per-token work repeats.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _default_inv_freq(head_size: int, theta: float) -> torch.Tensor:
    # Same arithmetic as the reference: int64 arange, cast to float32, then the power.
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    return 1.0 / (theta**exponents)  # (head_size // 2,)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth
    interpolation between the two bands."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq  # (head_size // 2,)
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(
    head_size: int, theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Inverse frequencies `(head_size // 2,)` float32 for `rope_scaling` (None: plain rope)."""
    inv_freq = _default_inv_freq(head_size, theta)
    rope_type = "default" if rope_scaling is None else rope_scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def apply_rotary_emb(
    x: torch.Tensor,  # (num_tokens, num_heads, head_size)
    cos: torch.Tensor,  # (num_tokens, head_size // 2)
    sin: torch.Tensor,  # (num_tokens, head_size // 2)
) -> torch.Tensor:
    """Rotates each (x[i], x[i + head_size/2]) pair by its position's angle."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # (num_tokens, num_heads, head_size // 2) each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (num_tokens, 1, head_size // 2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table for positions `[0, max_positions)` in the model dtype."""

    def __init__(
        self,
        head_size: int,
        max_positions: int,
        theta: float,
        rope_scaling: dict[str, Any] | None,
        *,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if head_size % 2:
            raise ValueError(f"rotary head_size must be even, got {head_size}")
        self.head_size = head_size
        self.max_positions = max_positions
        # Built on the CPU in float32 (as the reference does), then cast and moved once.
        device = torch.get_default_device()
        with torch.device("cpu"):
            inv_freq = compute_inv_freq(head_size, theta, rope_scaling)  # (head_size // 2,)
            positions = torch.arange(max_positions, dtype=torch.float32)
            angles = torch.outer(positions, inv_freq)  # (max_positions, head_size // 2)
        self.register_buffer("cos_cache", angles.cos().to(device, dtype), persistent=False)
        self.register_buffer("sin_cache", angles.sin().to(device, dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(cos, sin)`, each (num_tokens, head_size // 2), of `positions` (num_tokens,)."""
        return self.cos_cache[positions], self.sin_cache[positions]
