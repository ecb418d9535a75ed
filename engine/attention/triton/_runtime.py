"""What every kernel module of this package shares: Triton (or a stand-in) and input checks.

Triton is optional at import time: without it, `triton.jit` below is a stand-in that leaves
the kernel functions undecorated, so the modules (and their torch references) still import;
a host wrapper then refuses to launch with `require_triton`. The interpreter
(`TRITON_INTERPRET=1`, which runs kernels on CPU tensors) is chosen by Triton when a kernel
is decorated, so it must be in the environment before this package's kernel modules are
imported; this package never sets it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

    def _undecorated(fn: Any = None, **_: Any) -> Any:
        # `@triton.jit` and `@triton.jit(...)` both leave the function as it is.
        return fn if fn is not None else (lambda f: f)

    triton = SimpleNamespace(jit=_undecorated)
    # Only read at definition time, in the `tl.constexpr` annotations of kernel arguments.
    tl = SimpleNamespace(constexpr=int)

__all__ = [
    "HAS_TRITON",
    "SUPPORTED_DTYPES",
    "cdiv",
    "check_device",
    "check_dtype",
    "check_index_dtype",
    "is_interpreted",
    "next_power_of_2",
    "require_triton",
    "tl",
    "triton",
]

# Storage dtypes the kernels read and write; arithmetic always runs in float32.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def require_triton() -> None:
    """Raises ImportError with the fix when Triton is not installed."""
    if not HAS_TRITON:
        raise ImportError(
            "kvferry's Triton kernels need the `triton` package: `pip install triton` "
            "(on a machine without a GPU, also set TRITON_INTERPRET=1 before importing them)"
        )


def is_interpreted(kernel: Any) -> bool:
    """Whether `kernel` was decorated under TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_device(kernel: Any, **tensors: torch.Tensor) -> None:
    """Raises ValueError unless all `tensors` share one device the kernel can run on."""
    require_triton()
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listed}")
    device = next(iter(devices.values()))
    if device.type == "cpu" and not is_interpreted(kernel):
        raise ValueError(
            "CPU tensors run only under the Triton interpreter: set TRITON_INTERPRET=1 "
            "before kvferry's Triton kernels are first imported, or pass CUDA tensors"
        )


def check_dtype(name: str, tensor: torch.Tensor, expected: torch.dtype | None = None) -> None:
    """Raises ValueError when `tensor` is not a supported float dtype (or not `expected`)."""
    if tensor.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"{name} has dtype {tensor.dtype}; supported: {supported}")
    if expected is not None and tensor.dtype != expected:
        raise ValueError(f"{name} has dtype {tensor.dtype}, expected {expected}")


def check_index_dtype(name: str, tensor: torch.Tensor) -> None:
    """Raises ValueError unless `tensor` holds int32 or int64 indices."""
    if tensor.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1); tile sizes must be powers of two."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
