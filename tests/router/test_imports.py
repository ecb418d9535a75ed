"""The router reaches the engines over HTTP and Redis only: importing it loads neither the
engine (its server least of all) nor torch; the contracts both sides share load neither."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import kvferry.protocol
import kvferry.router


def modules_loaded_by(*names: str) -> list[str]:
    """Every module `import`ing `names` in a fresh interpreter loads."""
    code = f"import json, sys; import {', '.join(names)}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def submodules(package: object) -> list[str]:
    return [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]  # type: ignore[attr-defined]


def test_the_router_imports_neither_the_engine_nor_torch() -> None:
    names = submodules(kvferry.router)
    assert "kvferry.router.app" in names and "kvferry.router.flow" in names
    loaded = modules_loaded_by("kvferry.router", *names)
    assert [m for m in loaded if m.startswith("kvferry.engine")] == []
    assert "torch" not in loaded


def test_the_protocol_imports_no_engine_torch_or_web_framework() -> None:
    loaded = modules_loaded_by(*submodules(kvferry.protocol))
    # The block hash accepts NumPy arrays without needing NumPy.
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "fastapi", "starlette", "numpy")
             or m.startswith("kvferry.engine")]
    assert heavy == []
