"""Live `kvferry serve` processes for the server tests: real subprocesses on 127.0.0.1.

`server_factory(model_dir, *flags)` starts one on a free port and waits for `/health`; every
server started is killed (its process group) when the session ends. `live_server` is one
shared server (with an API key) for the tests that leave it serving.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvferry_testing.fixtures import redis_url  # noqa: F401 (fixture of test_registry)
from kvferry_testing.pd_pods import Trio, start_trio
from kvferry_testing.serve_helpers import API_KEY, ServerProcess, free_port, serve_command


@pytest.fixture(scope="session")
def tiny_model(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(vocab_size=256, max_position_embeddings=1024)


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """start(model, *flags, api_key=None, wait=True, env=None) -> a running ServerProcess."""
    started: list[ServerProcess] = []

    def start(model: str | Path, *flags: str, api_key: str | None = None,
              wait: bool = True, env: dict[str, str] | None = None) -> ServerProcess:
        port = free_port()
        log_path = tmp_path_factory.mktemp("serve") / "serve.log"
        key_flags = ("--api-key", api_key) if api_key else ()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(serve_command(str(model), port, *key_flags, *flags),
                                    stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, **(env or {})})
        server = ServerProcess(proc, port, log_path, api_key)
        started.append(server)
        if wait:
            server.wait_ready()
        return server

    yield start
    for server in started:
        server.kill_group()


@pytest.fixture(scope="session")
def live_server(server_factory: Callable[..., ServerProcess], tiny_model: Path) -> ServerProcess:
    """One server shared by the tests that leave it serving (API key set)."""
    return server_factory(tiny_model, "--served-model-name", "tiny", api_key=API_KEY)


@pytest.fixture(scope="session")
def trio(server_factory: Callable[..., ServerProcess], tiny_model: Path) -> Trio:
    """A prefill and a decode pod sharing the tests' transfer key, and a colocated pod."""
    return start_trio(server_factory, tiny_model)
