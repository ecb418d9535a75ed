"""Child processes of `kvferry up`: started, their log lines prefixed, restarted when they die.

Each child runs in its own process group so that Ctrl-C in the terminal reaches only
`kvferry up`, which then stops the children in order (router first, pods, Redis last). When
a child's process exits, the rest of its group goes with it, as a container's processes do
when it ends: a pod's engine core does not outlive its server.

Restarts follow a kubelet's rules for a crashing container (CrashLoopBackOff): the first
comes after 1 s, each next one waits twice as long, up to 60 s, and a process that ran for
10 minutes starts the count over. A child that exits MAX_FAILED_STARTS times in a row
without ever having been ready (its probe never passed) will not get better by trying again:
the supervisor gives up on it, keeps its last lines of output, and tells its owner, which
stops the whole run. One that was ready once is restarted for as long as the run lasts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

# Restart delays: the first, the doubling's cap, and how long a run must last to reset them.
BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 60.0
BACKOFF_RESET_S = 600.0
# Exits in a row before ever being ready after which a child is given up on.
MAX_FAILED_STARTS = 3
# How often a child's process is checked for its exit, and a starting child for readiness.
EXIT_POLL_S = 0.1
READY_POLL_S = 0.5
# How long the log lines still in the pipe are relayed after a child's group was killed.
DRAIN_S = 2.0
# How long a child has from SIGTERM to its exit before SIGKILL, unless its spec says.
STOP_TIMEOUT_S = 30.0
# Lines of a child's output kept from its last run, to show why it failed.
TAIL_LINES = 30
# Where the account of a failure starts in those lines: a traceback or an error line.
_ERROR_LINE = re.compile(r"Traceback \(most recent call last\)|\b(ERROR|CRITICAL)\b|error:")

Probe = Callable[[], Awaitable[bool]]


@dataclass
class ChildSpec:
    """One process to keep running."""

    name: str  # the prefix of its log lines (a pod name)
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = True  # start again when it exits while the service runs
    # From SIGTERM to SIGKILL when the service stops: at least the time it drains for.
    stop_timeout_s: float = STOP_TIMEOUT_S
    # True once the process serves (a pod's /health); None: ready as soon as it started.
    is_ready: Probe | None = None


@dataclass(frozen=True)
class GaveUp:
    """Why a child is not started again: it never became ready, MAX_FAILED_STARTS times."""

    name: str
    exit_code: int
    num_starts: int
    last_lines: list[str]  # its output from the first error line on (else its last lines)

    def describe(self) -> str:
        lines = "\n".join(f"  {line}" for line in self.last_lines) or "  (no output)"
        return (f"{self.name} exited {self.num_starts} times in a row before it was ready "
                f"(last exit status {self.exit_code}); its last lines:\n{lines}")


class Child:
    """A supervised process: its current OS process and the task that keeps it alive.

    `on_give_up` is called once, with the account, when the child is given up on.
    """

    def __init__(self, spec: ChildSpec, stopping: asyncio.Event,
                 on_give_up: Callable[[GaveUp], None] | None = None) -> None:
        self.spec = spec
        self.process: asyncio.subprocess.Process | None = None
        self.num_restarts = 0
        # Whether the current process passed its readiness probe; whether any one did.
        self.is_ready = False
        self.was_ever_ready = False
        self._stopping = stopping
        self._on_give_up = on_give_up
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._keep_running())

    async def _keep_running(self) -> None:
        delay = BACKOFF_INITIAL_S
        num_failed_starts = 0
        while not self._stopping.is_set():
            started = time.monotonic()
            code = await self._run_once()
            if self._stopping.is_set() or not self.spec.restart:
                return
            if time.monotonic() - started >= BACKOFF_RESET_S:
                delay = BACKOFF_INITIAL_S
            num_failed_starts = 0 if self.was_ever_ready else num_failed_starts + 1
            if num_failed_starts >= MAX_FAILED_STARTS:
                self._give_up(code, num_failed_starts)
                return
            when = time.strftime("%H:%M:%S", time.localtime(time.time() + delay))
            state = ("after it was ready" if self.is_ready else
                     "before it was ready again" if self.was_ever_ready else
                     f"before it was ever ready ({num_failed_starts} of {MAX_FAILED_STARTS})")
            self._say(f"exited with {code} {state}; restarting in {delay:g} s (at {when})")
            self.num_restarts += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    def _give_up(self, code: int, num_starts: int) -> None:
        gave_up = GaveUp(self.spec.name, code, num_starts, error_lines(list(self._tail)))
        self._say(f"exited with {code} before it was ready, {num_starts} times in a row; "
                  "not restarting it")
        if self._on_give_up is not None:
            self._on_give_up(gave_up)

    def _say(self, message: str) -> None:
        print(f"[{self.spec.name}] {message}", flush=True)

    async def _run_once(self) -> int:
        self.is_ready = False
        self._tail.clear()
        process = self.process = await asyncio.create_subprocess_exec(
            *self.spec.args, env={**os.environ, **self.spec.env}, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
        relay = asyncio.create_task(self._relay_lines(process))
        probe = asyncio.create_task(self._probe_until_ready())
        # Not process.wait(): it also waits until every holder of the output pipe (the
        # child's own children) has exited.
        while process.returncode is None:
            await asyncio.sleep(EXIT_POLL_S)
        probe.cancel()
        _kill_group(process.pid)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(relay, DRAIN_S)
        with contextlib.suppress(asyncio.CancelledError):
            await probe
        return process.returncode

    async def _probe_until_ready(self) -> None:
        probe = self.spec.is_ready
        while probe is not None and not await probe():
            await asyncio.sleep(READY_POLL_S)
        self.is_ready = self.was_ever_ready = True

    async def _relay_lines(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        prefix = f"[{self.spec.name}] ".encode()
        async for line in process.stdout:
            self._tail.append(line.decode(errors="replace").rstrip())
            sys.stdout.buffer.write(prefix + line)
            sys.stdout.flush()

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; waits for the exit."""
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def http_probe(host: str, port: int, path: str, timeout_s: float = 2.0) -> Probe:
    """A probe that passes when `GET path` answers 200 (as a kubelet's httpGet probe)."""

    async def probe() -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(host, port)
                try:
                    writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
                    status_line = await reader.readline()
                finally:
                    writer.close()
        except (OSError, TimeoutError):
            return False
        return status_line.split(b" ")[1:2] == [b"200"]

    return probe


def tcp_probe(host: str, port: int, timeout_s: float = 2.0) -> Probe:
    """A probe that passes when `host:port` accepts a connection (a tcpSocket probe)."""

    async def probe() -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                _, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError):
            return False
        writer.close()
        return True

    return probe


def error_lines(lines: list[str]) -> list[str]:
    """`lines` from the first that reports an error (a traceback, an ERROR line, a command's
    `error:`) to the end; all of them when none does."""
    for index, line in enumerate(lines):
        if _ERROR_LINE.search(line):
            return lines[index:]
    return lines


def _kill_group(pgid: int) -> None:
    """SIGKILL to what is left of a process group (nothing, usually)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
