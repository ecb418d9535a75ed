"""Processes the image tests start: each in its own process group, stopped with all its children."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 40.0  # longer than the engine's 30 s drain


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Process:
    """A started command, its log file, and the port it serves HTTP on (if any)."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_http(self, path: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until `GET path` answers 200; fails with the log if the process exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}{path}", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise AssertionError(f"{self.name}: GET {path} not 200 within {timeout_s} s:\n{self.log()}")

    def stop(self) -> int | None:
        """SIGTERM to the group (a server drains and stops its engine core), then SIGKILL to
        the group and to every descendant seen, which covers an engine core: it runs in a
        session of its own."""
        descendants = _descendants(self.proc.pid)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in descendants:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        return self.proc.returncode


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, read from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The command name is in parentheses and may hold spaces: split after it.
            fields = stat.read_text().rpartition(")")[2].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def start(name: str, command: Sequence[str], env: Mapping[str, str], log_dir: Path,
          port: int | None = None, cwd: Path | None = None) -> Process:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env=dict(env), cwd=cwd)
    return Process(name, proc, log_path, port)


def clean_env(bin_dir: Path, **overrides: str) -> dict[str, str]:
    """The environment of a command from `bin_dir`'s virtual environment, and nothing of ours.

    The developer's virtual environment, PYTHONPATH and caches are left out, so the command
    sees only what is installed in `bin_dir`'s environment.
    """
    keep = ("LANG", "LC_ALL", "TZ", "USER", "LOGNAME", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL",
            "PIP_FIND_LINKS", "PIP_CERT")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PATH"] = f"{bin_dir}{os.pathsep}/usr/local/bin{os.pathsep}/usr/bin{os.pathsep}/bin"
    return {**env, **overrides}
