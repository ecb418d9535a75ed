"""How the kernels meet their environment: without Triton, on CPU tensors without the
interpreter, and with Triton imported by torch before TRITON_INTERPRET is set."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from kvferry.engine.attention.triton import _runtime
from kvferry.engine.attention.triton.activation import silu_and_mul


def _run_python(source: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_package_imports_without_triton_and_kernels_say_what_to_install() -> None:
    result = _run_python("""
        import sys
        sys.modules["triton"] = None  # `import triton` now raises ImportError
        import torch
        from kvferry.engine.attention import triton as kernels
        from kvferry.engine.attention.triton_backend import TritonAttentionBackend
        assert not kernels.HAS_TRITON
        x = torch.randn(3, 8)
        assert kernels.silu_and_mul_reference(x).shape == (3, 4)  # references still work
        try:
            kernels.silu_and_mul(x)
        except ImportError as error:
            print(error)
    """)
    assert result.returncode == 0, result.stderr
    assert "need the `triton` package: `pip install triton`" in result.stdout


def test_interpreter_set_after_torch_imported_triton_still_applies() -> None:
    # torch._dynamo imports triton; the interpreter is read when kernels are decorated,
    # i.e. when kvferry's kernel modules are imported, so setting it later still works.
    result = _run_python("""
        import os, sys
        import torch, torch._dynamo
        assert "triton" in sys.modules
        os.environ["TRITON_INTERPRET"] = "1"
        from kvferry.engine.attention.triton.activation import silu_and_mul
        x = torch.randn(3, 8)
        expected = torch.nn.functional.silu(x[:, :4]) * x[:, 4:]
        torch.testing.assert_close(silu_and_mul(x), expected)
        print("interpreted")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "interpreted"


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch) -> None:
    monkeypatch.setattr(_runtime, "is_interpreted", lambda kernel: False)
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
        silu_and_mul(torch.randn(2, 8))


def test_tile_helpers() -> None:
    assert [_runtime.next_power_of_2(n) for n in (0, 1, 2, 3, 80, 96, 128, 129)] == [
        1,
        1,
        2,
        4,
        128,
        128,
        128,
        256,
    ]
    assert [_runtime.cdiv(n, 4) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
