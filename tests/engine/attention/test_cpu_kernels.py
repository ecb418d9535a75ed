"""The native CPU decode kernel: built here, cached per machine, optional, and harmless to
the floating-point state of the process that loads it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvferry.engine.attention import cpu_kernels

PROBE = (
    "from kvferry.engine.attention.cpu_kernels import paged_decode_kernel; "
    "print(paged_decode_kernel() is not None)"
)

# Whether denormals survive on the main thread before and after the kernel loads: Python
# floats (a denormal result: flush-to-zero; a denormal operand: denormals-are-zero), a numpy
# float32 and a torch float32 (one element: no worker thread computes it). The operands are
# arguments, so no product is folded into a constant before the kernel loads.
FLOAT_STATE_PROBE = """
import numpy as np
import torch
from kvferry.engine.attention.cpu_kernels import paged_decode_kernel

def denormals_survive(tiny=1e-310, one=1.0, small=2.5e-308, quarter=0.25, tiny32=1e-40):
    return (
        tiny * one != 0.0 and small * quarter != 0.0,
        bool(np.float32(tiny32) * np.float32(one) != 0),
        bool((torch.tensor([tiny32]) * one).item() != 0),
    )

before = denormals_survive()
loaded = paged_decode_kernel() is not None
print(before, loaded, denormals_survive())
"""


def _probe(env: dict[str, str], code: str = PROBE) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True,
        env={**os.environ, **env},
    ).stdout.strip()


def test_kernel_builds_once_into_the_cache(tmp_path) -> None:
    env = {"KVFERRY_CACHE": str(tmp_path)}
    assert _probe(env) == "True"
    built = list((tmp_path / "kernels").glob("paged_decode-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert _probe(env) == "True"  # a second process loads the cached build
    assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").iterdir()] == [stamp]


def test_kernel_can_be_switched_off(tmp_path) -> None:
    assert _probe({"KVFERRY_CACHE": str(tmp_path), cpu_kernels.ENV_SWITCH: "0"}) == "False"
    assert not (tmp_path / "kernels").exists()


def test_without_a_compiler_the_torch_path_remains(tmp_path) -> None:
    missing = str(tmp_path / "no-such-cc")
    assert _probe({"KVFERRY_CACHE": str(tmp_path), "CC": missing}) == "False"


def test_this_process_uses_the_kernel() -> None:
    # CI has a C compiler: the engine's tests run the native decode path.
    assert cpu_kernels.paged_decode_kernel() is not None


def test_loading_the_kernel_keeps_denormals(tmp_path) -> None:
    # A fresh interpreter and a fresh build: what earlier tests loaded cannot hide a library
    # that turns on flush-to-zero / denormals-are-zero when it loads.
    state = _probe({"KVFERRY_CACHE": str(tmp_path)}, FLOAT_STATE_PROBE)
    assert state == "(True, True, True) True (True, True, True)"


@pytest.mark.parametrize("flags", ["COMPILE_FLAGS", "LINK_FLAGS"])
def test_build_key_covers_compile_and_link_flags(monkeypatch, flags: str) -> None:
    # A build made with other flags (such as fast-math given to the linker) is never reused.
    key = cpu_kernels.build_key("cc 12.2.0")
    monkeypatch.setattr(cpu_kernels, flags, (*getattr(cpu_kernels, flags), "-ffast-math"))
    assert cpu_kernels.build_key("cc 12.2.0") != key
    assert cpu_kernels.build_key("cc 13.1.0") != cpu_kernels.build_key("cc 12.2.0")
