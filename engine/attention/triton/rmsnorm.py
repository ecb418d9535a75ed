"""RMSNorm, optionally fused with the residual add before it, one program per token.

Matches `kvferry.engine.layers.rmsnorm.RMSNorm`: the sum with the residual is rounded to
the model dtype (it is the next residual), the reduction runs in float32, and the
normalized row is cast back to the model dtype before the weight multiply.
"""

from __future__ import annotations

import torch
from kvferry.engine.attention.triton._runtime import (
    check_device,
    check_dtype,
    next_power_of_2,
    require_triton,
    tl,
    triton,
)

# One program holds a whole row in registers (up to 64 floats a thread at 8 warps).
MAX_HIDDEN_SIZE = 16384


@triton.jit
def _rmsnorm_kernel(
    # pointers
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    # sizes
    hidden_size,
    eps,
    # strides
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    # constexpr flags
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # hidden_size rounded up to a power of two
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # Rounded to the model dtype first: the reference adds in that dtype.
        s = (x + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, s, mask=mask)
        x = s.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / hidden_size
    normed = (x * tl.math.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, w * normed.to(tl.float32), mask=mask)


def _as_rows(name: str, x: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """(..., hidden_size) -> (num_rows, hidden_size) with a unit last stride."""
    if x.shape[-1] != hidden_size:
        raise ValueError(f"{name} has last dimension {x.shape[-1]}, weight has {hidden_size}")
    rows = x.reshape(-1, hidden_size)  # a view where the layout allows, else a copy
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _output_rows(name: str, out: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The (num_rows, hidden_size) rows to write: `out`'s, or a new tensor's."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device).view(-1, x.shape[-1])
    if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {x.dtype} tensor of {tuple(x.shape)}, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    return out.view(-1, x.shape[-1])


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton()
    hidden_size = weight.shape[-1]
    if weight.dim() != 1 or hidden_size > MAX_HIDDEN_SIZE:
        raise ValueError(
            f"weight must be (hidden_size,) with hidden_size <= {MAX_HIDDEN_SIZE}, got "
            f"{tuple(weight.shape)}"
        )
    check_dtype("x", x)
    check_dtype("weight", weight, x.dtype)
    rows = _as_rows("x", x, hidden_size)  # (num_rows, hidden_size)
    res_rows = rows
    if residual is not None:
        check_dtype("residual", residual, x.dtype)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} differs from x {tuple(x.shape)}")
        res_rows = _as_rows("residual", residual, hidden_size)
    out_rows = _output_rows("out", out, x)  # (num_rows, hidden_size)
    # Without a residual the kernel never touches the residual output: alias `out`.
    res_out_rows = out_rows if residual is None else _output_rows("residual_out", residual_out, x)
    check_device(
        _rmsnorm_kernel,
        x=x,
        weight=weight,
        residual=res_rows,
        out=out_rows,
        residual_out=res_out_rows,
    )
    block = next_power_of_2(hidden_size)
    if rows.shape[0]:
        _rmsnorm_kernel[(rows.shape[0],)](
            rows,
            res_rows,
            weight,
            out_rows,
            res_out_rows,
            hidden_size,
            eps,
            rows.stride(0),
            res_rows.stride(0),
            out_rows.stride(0),
            res_out_rows.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(8, max(1, block // 512)),
        )
    return out_rows.view(x.shape), res_out_rows.view(x.shape)


def rms_norm(
    x: torch.Tensor,  # (..., hidden_size)
    weight: torch.Tensor,  # (hidden_size,)
    eps: float,
    out: torch.Tensor | None = None,  # (..., hidden_size), contiguous
) -> torch.Tensor:  # (..., hidden_size)
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dimension, as `RMSNorm.forward`.

    Writes into `out` when given. Raises ValueError on mismatched shapes or dtypes.
    """
    normed, _ = _launch(x, None, weight, eps, out, None)
    return normed


def fused_add_rms_norm(
    x: torch.Tensor,  # (..., hidden_size)
    residual: torch.Tensor,  # (..., hidden_size)
    weight: torch.Tensor,  # (hidden_size,)
    eps: float,
    out: torch.Tensor | None = None,  # (..., hidden_size), contiguous
    residual_out: torch.Tensor | None = None,  # (..., hidden_size), contiguous
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns `(rms_norm(x + residual), x + residual)`, as `RMSNorm.add_and_norm`.

    Writes into `out` and `residual_out` when given.
    """
    return _launch(x, residual, weight, eps, out, residual_out)


def rms_norm_reference(
    x: torch.Tensor,  # (..., hidden_size)
    weight: torch.Tensor,  # (hidden_size,)
    eps: float,
    residual: torch.Tensor | None = None,  # (..., hidden_size)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain-torch RMSNorm: `(normed, x + residual)`, or `(normed, None)` without a residual."""
    if residual is not None:
        x = x + residual  # (..., hidden_size), in the model dtype
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)  # (..., 1)
    normed = weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)
    return normed, (x if residual is not None else None)
