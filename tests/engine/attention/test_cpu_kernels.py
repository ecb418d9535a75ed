"""The native CPU decode kernel: built here, cached per machine, and optional."""

from __future__ import annotations

import os
import subprocess
import sys

from kvferry.engine.attention import cpu_kernels

PROBE = (
    "from kvferry.engine.attention.cpu_kernels import paged_decode_kernel; "
    "print(paged_decode_kernel() is not None)"
)


def _probe(env: dict[str, str]) -> str:
    return subprocess.run(
        [sys.executable, "-c", PROBE], check=True, capture_output=True, text=True,
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
