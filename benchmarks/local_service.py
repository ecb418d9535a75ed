"""`kvferry up` of one InferenceService for a benchmark: started in its own session, every
process it starts accounted for (CPU seconds, time spent waiting for a core) and stopped at
the end, orphans included; and Prometheus samples read from its router and pods."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

STOP_TIMEOUT_S = 120.0  # `kvferry up` gives each child 30 s after the pods drain
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- processes -----------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """Direct children of `pid`, whichever of its threads started them."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                found += [int(c) for c in
                          Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return found


def descendants(pid: int) -> list[int]:
    out, pending = [], children(pid)
    while pending:
        child = pending.pop()
        out.append(child)
        pending += children(child)
    return out


def _stat_fields(pid: int) -> list[str]:
    # The command name in parentheses may hold spaces; the fields after it do not.
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def running_since(pid: int) -> int | None:
    """The start time in ticks of process `pid` (tells it from a later one with the same
    pid); None once it has exited, zombies included."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the live processes `pids` have used so far."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = _stat_fields(pid)
            ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS


def run_queue_wait_seconds(pids: list[int]) -> float:
    """Thread-seconds the live processes `pids` have been ready to run but waited for a core
    (the kernel's schedstat): what CPU contention cost them."""
    total_ns = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, IndexError):
                    total_ns += int(
                        Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[1])
    return total_ns / 1e9


def machine_busy_seconds() -> float:
    """CPU seconds all cores of the machine have been busy so far, anyone's processes."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def argv_of(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


# ---- metrics -------------------------------------------------------------------------------


def metric_sum(text: str, name: str, label_filter: str = "") -> float:
    """The sum of a Prometheus metric's samples whose labels contain `label_filter`."""
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text,
                             re.MULTILINE):
        if label_filter in (match.group(1) or ""):
            total += float(match.group(2))
    return total


# ---- the service ---------------------------------------------------------------------------


class LocalService:
    """`kvferry up -f MANIFEST` in its own session (Ctrl-C reaches the benchmark, which stops
    the service in order) and everything it starts."""

    def __init__(self, manifest: dict[str, Any], workdir: Path, env: dict[str, str]) -> None:
        self.name = manifest["metadata"]["name"]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{self.name}.log"
        path = workdir / f"{self.name}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        self.pods: dict[str, str] = {}  # pod name -> URL
        # Every process seen under `kvferry up` -> its start time: what to kill if it is left.
        self._seen: dict[int, int | None] = {}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvferry.cli", "up", "-f", str(path),
             "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while "ready: http" not in self.log():
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvferry up exited with {self.proc.returncode}:\n"
                                   + self.log()[-3000:])
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvferry up not ready in {timeout_s:.0f} s:\n"
                                   + self.log()[-3000:])
            time.sleep(0.2)
        self.pods = dict(re.findall(r"pod (\S+): (http://127\.0\.0\.1:\d+)", self.log()))
        self._note_processes()

    def _note_processes(self) -> None:
        self._seen |= {pid: running_since(pid) for pid in descendants(self.proc.pid)}

    def components(self) -> dict[str, list[int]]:
        """Pod name, "router" or "redis" -> the pids of that child's process tree."""
        by_port = {url.rsplit(":", 1)[1]: name for name, url in self.pods.items()}
        out: dict[str, list[int]] = {}
        for pid in children(self.proc.pid):
            argv = argv_of(pid)
            if "router" in argv:
                name = "router"
            elif "serve" in argv and "--port" in argv:
                name = by_port.get(argv[argv.index("--port") + 1], f"pid {pid}")
            else:
                name = "redis"
            out[name] = [pid, *descendants(pid)]
        return out

    def metrics(self, url: str | None = None) -> str:
        """The Prometheus text of the router (or of the pod at `url`)."""
        return httpx.get((url or self.url) + "/metrics", timeout=10, trust_env=False).text

    def stop(self) -> list[int]:
        """Stops `kvferry up` as Ctrl-C would and waits for it; then kills whatever it left
        (it was killed, or it did not stop within STOP_TIMEOUT_S). Returns the pids killed."""
        self._note_processes()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        killed = []
        for pid, started in self._seen.items():
            if started is not None and running_since(pid) == started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        self._log.close()
        return killed
