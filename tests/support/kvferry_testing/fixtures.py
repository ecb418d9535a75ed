"""Fixtures shared by several test folders; a conftest imports the ones it needs by name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvferry_testing.procs import redis_server


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis server on a loopback port, one per test module."""
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url
