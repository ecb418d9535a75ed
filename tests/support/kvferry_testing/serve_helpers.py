"""Helpers of the server tests: a `kvferry serve` subprocess and what it can be asked."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

API_KEY = "test-key"
# The tiny checkpoint's limits, shared by the server and the offline comparisons.
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 64 * 1024 * 1024
START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    """One `kvferry serve` subprocess."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    api_key: str | None
    # Seen while waiting for readiness: (/ping status, /health status) pairs.
    probes: list[tuple[int, int]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """`name{labels}` -> value of every sample on /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def metric(self, name: str) -> float:
        """The value of a metric with only the model_name label."""
        matches = [v for k, v in self.metrics().items() if k.split("{")[0] == name]
        assert len(matches) == 1, (name, matches)
        return matches[0]

    def wait_metric(self, name: str, value: float, timeout_s: float = 10.0) -> None:
        """Waits until metric `name` reads `value` (gauges change with the engine's steps,
        which may come just after the last answer)."""
        deadline = time.monotonic() + timeout_s
        while (seen := self.metric(name)) != value:
            assert time.monotonic() < deadline, f"{name} is {seen}, not {value}"
            time.sleep(0.05)

    def peak_metric_while(self, name: str, calls: list[Callable[[], object]],
                          concurrency: int) -> float:
        """Runs `calls` on `concurrency` threads while reading metric `name` over and over;
        returns the largest value read. A call's exception is raised here."""
        with ThreadPoolExecutor(concurrency) as pool:
            futures = [pool.submit(call) for call in calls]
            peak = self.metric(name)
            while not all(f.done() for f in futures):
                peak = max(peak, self.metric(name))
                time.sleep(0.01)
            for future in futures:
                future.result()
        return peak

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"kvferry serve exited with {self.proc.returncode}:\n"
                                     f"{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                ping = httpx.get(f"{self.url}/ping", timeout=2).status_code
                health = httpx.get(f"{self.url}/health", timeout=2).status_code
                self.probes.append((ping, health))
                if health == 200:
                    return
            time.sleep(0.1)
        raise AssertionError(f"kvferry serve not ready in {timeout_s} s:\n{self.log()}")

    def kill_group(self) -> None:
        """Kills the server and its engine-core process (same process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def engine_pid(self) -> int:
        """The engine-core process: the server's child running kvferry.engine.frontend.core_process."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                             text=True, check=False).stdout.split()
        for pid in out:
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"core_process" in cmdline:
                    return int(pid)
        raise AssertionError(f"no engine-core child of {self.proc.pid} among {out}")


def serve_command(model: str, port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "kvferry.cli", "serve", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *flags]


