"""The README's two commands, as a user meets them on a fresh clone.

The first installs what serving needs (the CPU build of torch and the serving extras) and
runs the demo service once; the second installs the test extras and helm and runs the
tests, and it is what CI runs. The commands are read from the README, never copied here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kvferry_testing.image_files import (
    CI_RUN,
    README,
    TORCH_PIN,
    clone_tree,
    extras_closure,
    pip_install_extras,
    readme_commands,
    script_commands,
)

SERVING_EXTRAS = {"serve", "kvtransfer"}
DEMO_RUN = 'kvferry up --once "Hello"'
# Distributions serving must not need: the test tooling, the reference model library, the
# operator's framework, the benchmarks' tools.
NOT_FOR_SERVING = {"pytest", "pytest-asyncio", "hypothesis", "kmock", "kubernetes-validate",
                   "openai", "transformers", "kopf", "matplotlib", "vllm-router"}
FIRST_RUN_TIMEOUT_S = 1800


def _steps(command: str) -> list[str]:
    return [step.strip() for step in command.split("&&")]


def test_the_first_command_installs_torch_and_the_serving_extras_then_runs_the_demo() -> None:
    first, _ = readme_commands()
    steps = _steps(first)
    assert steps[0] == f"pip install {TORCH_PIN}", first
    assert [extras for step in steps for extras in pip_install_extras(step)] == [SERVING_EXTRAS]
    assert steps[-1] == DEMO_RUN, first
    assert extras_closure(SERVING_EXTRAS) & NOT_FOR_SERVING == set()


def test_the_second_command_installs_the_test_extras_and_helm_then_runs_the_tests() -> None:
    _, second = readme_commands()
    steps = _steps(second)
    assert steps[0] == f"pip install {TORCH_PIN}", second
    assert [extras for step in steps for extras in pip_install_extras(step)] == [{"test"}]
    assert "bash .ci/install-helm.sh" in steps, second
    assert steps[-1] == "python -m pytest -q", second
    # The tests need the serving extras, the operator's and their own tooling.
    assert extras_closure(SERVING_EXTRAS | {"operator"}) <= extras_closure({"test"})


def test_ci_runs_the_readmes_second_command_as_written() -> None:
    _, second = readme_commands()
    assert script_commands(CI_RUN.read_text()) == [second]


def test_the_readme_names_every_extra() -> None:
    text = README.read_text()
    for extra in ("serve", "kvtransfer", "operator", "test"):
        assert f"| `{extra}` |" in text, extra


@pytest.mark.slow
def test_the_first_command_runs_as_written_on_a_fresh_clone(tmp_path: Path) -> None:
    """In a new virtual environment that sees nothing of this one (no system site packages),
    the README's first command, run by bash in a copy of the clone, installs what serving
    needs and answers "Hello" through the demo service; transformers and the test tooling
    are not installed."""
    first, _ = readme_commands()
    clone = clone_tree(tmp_path / "clone")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120,
                   cwd=tmp_path)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "KVFERRY_CACHE")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               KVFERRY_CACHE=str(tmp_path / "cache"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(["bash", "-c", first], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=FIRST_RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    assert re.search(r"^'Hello' -> '.+'$", done.stdout, flags=re.MULTILINE), done.stdout[-6000:]
    assert "Traceback" not in done.stdout + done.stderr
    code = ("import importlib.util as u, sys\n"
            "print(sorted(m for m in sys.argv[1:] if u.find_spec(m)))")
    found = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code,
         "transformers", "pytest", "kopf", "kmock", "openai", "kvferry", "nixl_cu12", "celpy"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert found.stdout.strip() == "['celpy', 'kvferry', 'nixl_cu12']", found
