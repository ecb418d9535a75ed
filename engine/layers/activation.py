"""Gated activations for the MLP's fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: `silu(gate) * up` where `gate_up` holds gate and up side by side.

    gate_up: (num_tokens, 2 * intermediate_size) -> (num_tokens, intermediate_size).
    """
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :half], gate_up[..., half:]  # (num_tokens, intermediate_size) each
    return F.silu(gate) * up
