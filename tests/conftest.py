"""Test-wide setup: Triton's interpreter where there is no GPU (the `gpu` marker itself is
registered in pyproject.toml).

Triton chooses between compiling a kernel and interpreting it (on CPU tensors) when the
kernel is decorated, from TRITON_INTERPRET. This conftest is imported before any test
module, so setting it here, before kvferry's kernel modules are imported, is early enough
(`triton` itself may already be imported, e.g. by torch, without harm).
"""

from __future__ import annotations

import importlib.util
import os


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: object) -> None:
    """Processes the session starts are stopped even if the session is killed (see
    kvferry_testing.reaper)."""
    if os.path.isdir("/proc"):
        from kvferry_testing import reaper

        reaper.start()
