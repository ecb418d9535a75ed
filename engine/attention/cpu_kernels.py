"""Native CPU kernels for the torch backend, built on first use with the system C compiler.

`csrc/paged_decode.c` reads keys and values in place from the paged cache, where the
plain-torch decode path must first copy them out block by block. It is compiled once per
machine into the cache directory (`$KVFERRY_CACHE/kernels`, default
`~/.cache/kvferry/kernels`) under a name derived from the source, the compiler and the
CPU's instruction-set flags, and loaded with ctypes. OpenMP inside the kernel binds to
the `libgomp` torch has already loaded, so both share one thread pool.

Where no compiler is available, or `KVFERRY_CPU_KERNELS=0`, the backend keeps the
plain-torch path; the outputs agree to float32 rounding either way.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# -ffast-math lets the compiler vectorize expf through glibc's vector math library and
# reassociate the dot products; every value the kernel handles is finite. It is given to the
# compile step only: at link time it makes the compiler add crtfastmath.o, whose constructor
# turns on flush-to-zero and denormals-are-zero for the thread that loads the library, which
# would change floating point for the whole Python process (`1e-310 * 1.0 == 0.0`).
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11", "-c")
LINK_FLAGS = ("-shared", "-fopenmp")
ENV_SWITCH = "KVFERRY_CPU_KERNELS"

_i64, _i32, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ptr = ctypes.c_void_p
_ARGTYPES = [
    _ptr, _ptr, _ptr,  # query, key_cache, value_cache
    _i64, _ptr, _i64,  # block_stride, block_tables, block_table_stride
    _ptr, _ptr, _ptr,  # req_rows, token_rows, seq_lens
    _i64, _i32, _i32, _i32, _i32,  # num_seqs, num_heads, num_kv_heads, head_size, block_size
    _i32, _f32, _ptr,  # max_seq_len, scale, out
]


def cache_dir() -> Path:
    root = os.environ.get("KVFERRY_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "kvferry") / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build_key(compiler_version: str) -> str:
    """Names a build by everything that shapes it; a new recipe never loads an old build."""
    recipe = (
        SOURCE.read_text(),
        " ".join(COMPILE_FLAGS),
        " ".join(LINK_FLAGS),
        compiler_version,
        _cpu_flags(),
    )
    return hashlib.sha256("\0".join(recipe).encode()).hexdigest()[:16]


def _build(compiler: str, target: Path) -> None:
    """Compiles the source to `target` atomically (a concurrent build cannot tear it).

    Two commands, so that the fast-math flags reach the compiler and not the linker.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp_dir:
        obj, lib = Path(tmp_dir) / "paged_decode.o", Path(tmp_dir) / "paged_decode.so"
        for command in (
            [compiler, *COMPILE_FLAGS, str(SOURCE), "-o", str(obj)],
            [compiler, *LINK_FLAGS, str(obj), "-o", str(lib), "-lm"],
        ):
            subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(lib, target)


class PagedDecodeKernel:
    """ctypes front of `kvferry_paged_decode_f32`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.kvferry_paged_decode_f32
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int

    def __call__(
        self,
        query: torch.Tensor,  # (num_tokens, num_heads, head_size) float32, contiguous
        key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size) view
        value_cache: torch.Tensor,  # same layout as key_cache
        block_tables: torch.Tensor,  # (num_reqs, max_blocks) int32, contiguous rows
        req_rows: torch.Tensor,  # (num_seqs,) int64: block-table row of each decode
        token_rows: torch.Tensor,  # (num_seqs,) int64: its query/output row
        seq_lens: torch.Tensor,  # (num_seqs,) int32
        max_seq_len: int,
        scale: float,
        out: torch.Tensor,  # like query; the decode rows are written
    ) -> None:
        num_heads, head_size = query.shape[1:]
        block_size, num_kv_heads = key_cache.shape[1:3]
        if key_cache.stride(0) != value_cache.stride(0) or block_tables.stride(1) != 1:
            raise ValueError("paged decode kernel: unexpected cache or block table layout")
        failed = self._fn(
            query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            key_cache.stride(0), block_tables.data_ptr(), block_tables.stride(0),
            req_rows.data_ptr(), token_rows.data_ptr(), seq_lens.data_ptr(),
            req_rows.numel(), num_heads, num_kv_heads, head_size, block_size,
            max_seq_len, scale, out.data_ptr(),
        )
        if failed:
            raise MemoryError("paged decode kernel could not allocate its scratch memory")


_kernel: PagedDecodeKernel | None | bool = False  # False: not tried yet


def paged_decode_kernel() -> PagedDecodeKernel | None:
    """The compiled kernel, or None where it cannot be built here (logged once)."""
    global _kernel
    if _kernel is not False:
        return _kernel  # type: ignore[return-value]
    _kernel = None
    if os.environ.get(ENV_SWITCH, "1") == "0":
        logger.info("native CPU kernels disabled by %s=0", ENV_SWITCH)
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU decode attention uses the plain torch path")
        return None
    try:
        version = subprocess.run(
            [compiler, "--version"], check=True, capture_output=True, text=True
        ).stdout
        target = cache_dir() / f"paged_decode-{build_key(version)}.so"
        if not target.exists():
            _build(compiler, target)
            logger.info("built the CPU paged decode kernel: %s", target)
        _kernel = PagedDecodeKernel(ctypes.CDLL(str(target)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        logger.warning("CPU decode kernel unavailable (%s): using the plain torch path",
                       detail.strip().splitlines()[-1] if detail.strip() else exc)
    return _kernel
