"""Shared engine fixtures: `make_checkpoint`, `hf_model` and `make_encdec_checkpoint` (from
`kvferry_testing`), and `process_report()`, which describes the test process for the
failure message of a numerical comparison: which tests ran before in this process, thread
counts, whether denormals are flushed, the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from kvferry_testing.checkpoints import (  # noqa: F401 (fixtures)
    demo_checkpoint,
    hf_model,
    make_checkpoint,
)
from kvferry_testing.encdec_checkpoints import make_encdec_checkpoint  # noqa: F401 (fixture)

# Node ids of the tests this process has started, in order.
_started_tests: list[str] = []


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _started_tests.append(nodeid)


def _flushes(tiny: float, factor: float) -> bool:
    # A function, so that the product is computed here at run time (never constant-folded).
    return tiny * factor == 0.0


def _float_control_state() -> list[str]:
    """Flush-to-zero / denormals-are-zero as seen by the main thread and torch's workers."""
    # Bit pattern 1: the smallest float32 denormal. A parallel multiply spreads it over
    # torch's intra-op threads, each with its own control register.
    denormals = torch.ones(1 << 20, dtype=torch.int32).view(torch.float32)
    flushed = int(((denormals * 2.0) == 0).sum())
    return [
        # A normal input with a denormal result is zero only under flush-to-zero (FTZ); a
        # denormal input with a normal result only under denormals-are-zero (DAZ).
        f"main thread: FTZ {_flushes(2.5e-308, 0.25)}, DAZ {_flushes(1e-310, 1e10)}, "
        f"numpy float32 denormal flushed {bool(np.float32(1e-40) * np.float32(1.0) == 0)}",
        f"torch parallel multiply: {flushed} of {denormals.numel()} float32 denormals flushed",
    ]


def _loaded_libraries(*names: str) -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return ["(no /proc/self/maps)"]
    return sorted(p for p in paths if any(n in Path(p).name for n in names))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def describe_process() -> str:
    """What tells causes of a process-dependent numerical difference apart."""
    before = _started_tests[:-1]
    modules = list(dict.fromkeys(nodeid.split("::")[0] for nodeid in before))
    lines = [
        f"tests run before this one in this process: {len(before)}, from "
        f"{', '.join(modules) or 'no module'}; the last ones: {', '.join(before[-8:])}",
        f"torch threads {torch.get_num_threads()}, interop threads "
        f"{torch.get_num_interop_threads()}, CPUs usable {len(os.sched_getaffinity(0))}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS')}",
        *_float_control_state(),
        f"native kernels loaded: {_loaded_libraries('paged_decode-') or 'none'}",
        f"CPU: {_cpu_model()} ({os.cpu_count()} logical CPUs), torch {torch.__version__}",
    ]
    return "\n".join(lines)


@pytest.fixture
def process_report() -> Callable[[], str]:
    """`describe_process` for failure messages (`torch.testing.assert_close(..., msg=...)`)."""
    return describe_process
