"""The operator's runtime: no torch, and no test tooling (the API emulator, schema validators)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import tomllib

import kvferry.operator
from kvferry_testing.operator_factories import ROOT

RUNTIME_MODULES = [f"kvferry.operator.{m.name}" for m in pkgutil.iter_modules(kvferry.operator.__path__)]
TEST_TOOLING = ("kmock", "kubernetes_validate")


def test_runtime_imports_neither_torch_nor_test_tooling() -> None:
    code = (f"import sys; import {', '.join(RUNTIME_MODULES)}; "
            f"print([m for m in ('torch', *{TEST_TOOLING!r}) if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_emulator_wrapper_lives_with_the_tests() -> None:
    assert "kvferry.operator.emulator" not in RUNTIME_MODULES
    assert (ROOT / "tests" / "support" / "kvferry_testing" / "kube_emulator.py").exists()


def test_test_tooling_is_only_in_the_test_extra() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    runtime = " ".join(extras["operator"])
    assert not any(tool.replace("_", "-") in runtime for tool in TEST_TOOLING)
    assert any(d.startswith("kmock") for d in extras["test"])
    assert "kmock" not in (ROOT / "Dockerfile").read_text()
