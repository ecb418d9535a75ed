"""Keeps glibc's allocator from handing large activation buffers back to the kernel.

A forward pass on CPU allocates activations of several MiB per op (a prefill chunk's
MLP output is `tokens x 2 x intermediate_size` floats). glibc serves blocks above its
mmap threshold with fresh `mmap` calls and trims the heap top when it shrinks, so each
such buffer is new memory the kernel must fault in page by page, every layer of every
step; on a VM this can double a large GEMM's time. Raising the mmap threshold to its
maximum and keeping freed memory in the heap makes those buffers reuse warm pages.

This is a process-wide setting, applied once by the CPU model runner. Other C libraries
(musl, or jemalloc/tcmalloc preloaded) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

# glibc caps the mmap threshold at 4 MiB * sizeof(long): 32 MiB on 64-bit systems.
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at the heap top kept for reuse instead of being returned to the kernel.
TRIM_THRESHOLD_BYTES = 1 << 30
# Extra room requested whenever the heap grows, so growth happens in few steps.
TOP_PAD_BYTES = 64 << 20

_applied: bool | None = None


def keep_activation_memory() -> bool:
    """Applies the settings once per process; returns whether glibc accepted them."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        # gnu_get_libc_version exists only in glibc: other libcs are left alone.
        libc.gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (M_TOP_PAD, TOP_PAD_BYTES),
    )
    _applied = all(mallopt(param, value) == 1 for param, value in settings)
    if _applied:
        logger.info(
            "glibc malloc: mmap threshold %d MiB, trim threshold %d MiB",
            MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20,
        )
    return _applied
