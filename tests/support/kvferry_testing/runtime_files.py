"""The files the package loads at run time, found in the code's own module constants.

Run as a script with the interpreter of the environment to inspect:

    python tests/image/runtime_files.py

It imports every module of `kvferry` and prints, as JSON, each module-level `Path` constant
that names something inside the package (a kernel source, the CRD, a template), mapped to
its place in the wheel (`kvferry/engine/attention/csrc/paged_decode.c`), whether it exists
in this environment, and every module that failed to import (a constant in it would be
missed). A new data file the code loads through a module constant is covered without
touching the tests.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
import traceback
from pathlib import PurePath
from types import ModuleType
from typing import Any

# The subpackages setup.py maps from top-level folders; walking one covers its subpackages,
# and in an installed wheel they all lie under `kvferry/` anyway.
SUBPACKAGES = ("kvferry", "kvferry.engine", "kvferry.kvtransfer", "kvferry.router",
               "kvferry.operator")


def _roots() -> dict[str, str]:
    """Import name -> directory of each subpackage present in this environment."""
    roots = {}
    for name in SUBPACKAGES:
        try:
            package = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        roots[name] = os.path.abspath(next(iter(package.__path__)))
    return roots


def _modules(roots: dict[str, str]) -> tuple[list[ModuleType], dict[str, str]]:
    modules: dict[str, ModuleType] = {}
    failed: dict[str, str] = {}
    for name, root in roots.items():
        modules[name] = importlib.import_module(name)
        for info in pkgutil.walk_packages([root], f"{name}.", onerror=lambda n: None):
            if info.name in modules or info.name in failed:
                continue
            try:
                modules[info.name] = importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - every failure is reported, with its traceback
                failed[info.name] = traceback.format_exc(limit=3)
    return list(modules.values()), failed


def _wheel_path(path: str, roots: dict[str, str]) -> str | None:
    """`path` as it lies in the wheel, or None when it is outside every subpackage."""
    best = max((r for r in roots.items() if path.startswith(r[1] + os.sep)),
               key=lambda r: len(r[1]), default=None)
    if best is None:
        return None
    name, root = best
    return "/".join([*name.split("."), *PurePath(os.path.relpath(path, root)).parts])


def runtime_files() -> dict[str, Any]:
    roots = _roots()
    modules, failed = _modules(roots)
    constants = []
    for module in modules:
        for attr, value in vars(module).items():
            if not isinstance(value, PurePath):
                continue
            # abspath, not resolve: a link inside the package (operator/crds) is what ships.
            path = os.path.abspath(value)
            in_wheel = _wheel_path(path, roots)
            if in_wheel is not None:
                constants.append({"constant": f"{module.__name__}.{attr}", "path": path,
                                  "wheel_path": in_wheel, "exists": os.path.exists(path),
                                  "is_dir": os.path.isdir(path)})
    return {"python": sys.executable, "constants": constants, "import_failures": failed}


if __name__ == "__main__":
    print(json.dumps(runtime_files(), indent=1, sort_keys=True))
