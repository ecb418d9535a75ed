"""SiLU-and-mul (SwiGLU) over the MLP's fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvferry.engine.attention.triton._runtime import (
    cdiv,
    check_device,
    check_dtype,
    next_power_of_2,
    require_triton,
    tl,
    triton,
)

# Columns per program: wide enough to stream, small enough for the interpreter's arrays.
MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    # pointers
    gate_up_ptr,
    out_ptr,
    # sizes
    intermediate_size,
    # strides
    stride_in,
    stride_out,
    # constexpr flags
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + intermediate_size + cols, mask=mask, other=0.0)
    # Rounded to the model dtype between the two steps, as the two torch ops round.
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, silu.to(tl.float32) * up.to(tl.float32), mask=mask)


def silu_and_mul(
    gate_up: torch.Tensor,  # (..., 2 * intermediate_size)
    out: torch.Tensor | None = None,  # (..., intermediate_size), contiguous
) -> torch.Tensor:  # (..., intermediate_size)
    """`silu(gate) * up` where `gate_up` holds gate and up side by side, gate first.

    Writes into `out` when given. Raises ValueError on an odd last dimension, an
    unsupported dtype or an `out` that does not fit.
    """
    require_triton()
    check_dtype("gate_up", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must have an even last dimension, got {tuple(gate_up.shape)}")
    intermediate_size = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, gate_up.shape[-1])  # (num_rows, 2 * intermediate_size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_shape = (*gate_up.shape[:-1], intermediate_size)
    if out is None:
        out = rows.new_empty(out_shape)
    elif out.shape != out_shape or out.dtype != gate_up.dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {gate_up.dtype} tensor of {out_shape}, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    check_device(_silu_and_mul_kernel, gate_up=gate_up, out=out)
    out_rows = out.view(-1, intermediate_size)  # (num_rows, intermediate_size)
    block = min(next_power_of_2(intermediate_size), MAX_BLOCK)
    if rows.shape[0] and intermediate_size:
        grid = (rows.shape[0], cdiv(intermediate_size, block))
        _silu_and_mul_kernel[grid](
            rows, out_rows, intermediate_size, rows.stride(0), out_rows.stride(0), BLOCK=block
        )
    return out


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain-torch SiLU-and-mul: (..., 2 * intermediate_size) -> (..., intermediate_size)."""
    gate, up = gate_up.chunk(2, dim=-1)  # (..., intermediate_size) each
    return F.silu(gate) * up
