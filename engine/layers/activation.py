"""Activations: the gated one of the MLP's fused gate/up projection, and GELU by name."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: `silu(gate) * up` where `gate_up` holds gate and up side by side.

    gate_up: (num_tokens, 2 * intermediate_size) -> (num_tokens, intermediate_size).
    """
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :half], gate_up[..., half:]  # (num_tokens, intermediate_size) each
    return F.silu(gate) * up


# The GELU spellings of HF configs' `activation_function`: the exact (erf) form, and the
# tanh approximation under its two names.
_GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
SUPPORTED_GELU_ACTIVATIONS: tuple[str, ...] = tuple(_GELU_APPROXIMATIONS)


def gelu_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The element-wise GELU a config names; ValueError for any other activation."""
    if name not in _GELU_APPROXIMATIONS:
        raise ValueError(
            f"activation_function {name!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_GELU_ACTIVATIONS)}"
        )
    return functools.partial(F.gelu, approximate=_GELU_APPROXIMATIONS[name])
