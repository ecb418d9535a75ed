"""Shared helpers of the end-to-end tests: the emulator, a kubeconfig, the operator process."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from kvferry_testing.fixtures import redis_url  # noqa: F401 (fixture of test_up)
from kvferry_testing.kube_emulator import OperatorProcess, emulated_cluster, write_kubeconfig

TEST_TIMEOUT_SECONDS = 60


@pytest.fixture
def run_async() -> Callable[[Coroutine[Any, Any, Any]], Any]:
    """Run one coroutine to completion with a hard time limit."""
    def run(coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT_SECONDS))
    return run


@pytest.fixture
def cluster(tmp_path: Path) -> Callable[[], contextlib.AbstractAsyncContextManager[Any]]:
    """`async with cluster() as (k, client, start_operator):` an emulator and a way to run
    the operator against it (each `start_operator()` is an async context manager)."""

    @contextlib.asynccontextmanager
    async def open_cluster() -> AsyncIterator[Any]:
        async with emulated_cluster() as (k, client):
            kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", str(k.url))

            def start_operator(*extra_args: str) -> OperatorProcess:
                return OperatorProcess(kubeconfig, tmp_path / "operator.log", *extra_args)

            try:
                yield k, client, start_operator
            except BaseException:
                log = tmp_path / "operator.log"
                if log.exists():
                    print(log.read_text()[-6000:])
                raise

    return open_cluster


def pytest_configure(config: object) -> None:
    """Processes the session starts are stopped even if the session is killed (see
    kvferry_testing.reaper)."""
    if os.path.isdir("/proc"):
        from kvferry_testing import reaper

        reaper.start()
