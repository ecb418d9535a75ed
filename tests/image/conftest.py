"""Fixtures of the image tests: the wheel the image installs, and the image's environment.

Both are built once per session: the wheel from a copy of the tree as `docker build` sees
it, the environment as a fresh virtual environment with the wheel and exactly the extras
the Dockerfile names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from kvferry_testing.image_files import build_context, build_wheel, create_venv, dockerfile_extras
from kvferry_testing.image_processes import Process, start


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kvferry wheel built from the Docker build context."""
    context = build_context(tmp_path_factory.mktemp("context"))
    return build_wheel(context, tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def image_bin(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bin/ of a fresh virtual environment holding what the image holds."""
    return create_venv(tmp_path_factory.mktemp("image") / "venv", wheel, dockerfile_extras())


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Process]]:
    """launch(name, command, env, port=None, cwd=None) -> a started Process; each one is
    stopped, with its whole process group, when the test ends."""
    started: list[Process] = []

    def launch_(name: str, command: Sequence[str], env: Mapping[str, str], port: int | None = None,
                cwd: Path | None = None) -> Process:
        process = start(name, command, env, tmp_path, port=port, cwd=cwd)
        started.append(process)
        return process

    yield launch_
    for process in reversed(started):
        process.stop()
