"""The wheel carries every file the package loads at run time, not only its Python modules.

An editable install reads the source tree, so a data file missing from the wheel shows only
where the wheel is installed: in the image. The files are found in the code's own module
constants (runtime_files.py), so a new one is covered without editing this test.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from kvferry_testing.image_files import ROOT, runtime_files

# Sources of native kernels, compiled where they run (the CPU kernel on first use).
KERNEL_SOURCE_SUFFIXES = (".c", ".h", ".cu", ".cuh")


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


@pytest.fixture(scope="module")
def source_report() -> dict[str, Any]:
    """runtime_files.py's report on the source tree (the environment running the tests)."""
    return runtime_files(sys.executable)


def test_the_source_tree_names_its_runtime_files(source_report: dict[str, Any]) -> None:
    report = source_report
    assert report["import_failures"] == {}
    # The two known today (the CPU kernel's source, the CRD) must be found, or the scan
    # finds nothing at all; matched by file name, wherever their modules move.
    names = {c["wheel_path"].rpartition("/")[2]: c["wheel_path"] for c in report["constants"]}
    assert names["paged_decode.c"].startswith("kvferry/engine/")
    assert names["inferenceservices.kvferry.dev.yaml"] == \
        "kvferry/operator/crds/inferenceservices.kvferry.dev.yaml"
    missing = [c["constant"] for c in report["constants"] if not c["exists"]]
    assert missing == [], f"constants naming files that do not exist: {missing}"


def test_the_wheel_ships_every_file_the_code_loads(
    wheel: Path, source_report: dict[str, Any]
) -> None:
    shipped = wheel_files(wheel)
    for constant in source_report["constants"]:
        path = constant["wheel_path"]
        if constant["is_dir"]:
            present = any(name.startswith(path + "/") for name in shipped)
        else:
            present = path in shipped
        assert present, f"{constant['constant']} names {path}, which the wheel lacks"


def test_the_wheel_ships_every_kernel_source(wheel: Path) -> None:
    # Kernels to come are loaded the same way; their sources ship by suffix, wherever they lie.
    sources = sorted(p.relative_to(ROOT / "engine").as_posix() for p in (ROOT / "engine").rglob("*")
                     if p.suffix in KERNEL_SOURCE_SUFFIXES)
    assert sources, "no kernel source found under engine/"
    shipped = wheel_files(wheel)
    assert [s for s in sources if f"kvferry/engine/{s}" not in shipped] == []
