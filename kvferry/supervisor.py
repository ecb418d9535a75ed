"""Child processes of `kvferry up`: started, their log lines prefixed, restarted when they die.

Each child runs in its own process group so that Ctrl-C in the terminal reaches only
`kvferry up`, which then stops the children in order (router first, pods, Redis last). When
a child's process exits, the rest of its group goes with it, as a container's processes do
when it ends: a pod's engine core does not outlive its server, and the pod restarts at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from dataclasses import dataclass, field

# A child that dies is started again after this long, as a kubelet would (without backoff).
RESTART_DELAY_S = 1.0
# How often a child's process is checked for its exit.
EXIT_POLL_S = 0.1
# How long the log lines still in the pipe are relayed after a child's group was killed.
DRAIN_S = 2.0
# How long a child has from SIGTERM to its exit before SIGKILL, unless its spec says.
STOP_TIMEOUT_S = 30.0


@dataclass
class ChildSpec:
    """One process to keep running."""

    name: str  # the prefix of its log lines (a pod name)
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = True  # start again when it exits while the service runs
    # From SIGTERM to SIGKILL when the service stops: at least the time it drains for.
    stop_timeout_s: float = STOP_TIMEOUT_S


class Child:
    """A supervised process: its current OS process and the task that keeps it alive."""

    def __init__(self, spec: ChildSpec, stopping: asyncio.Event) -> None:
        self.spec = spec
        self.process: asyncio.subprocess.Process | None = None
        self.num_restarts = 0
        self._stopping = stopping
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._keep_running())

    async def _keep_running(self) -> None:
        while not self._stopping.is_set():
            code = await self._run_once()
            if self._stopping.is_set() or not self.spec.restart:
                return
            print(f"[{self.spec.name}] exited with {code}; restarting in {RESTART_DELAY_S:.0f} s",
                  flush=True)
            self.num_restarts += 1
            await asyncio.sleep(RESTART_DELAY_S)

    async def _run_once(self) -> int:
        process = self.process = await asyncio.create_subprocess_exec(
            *self.spec.args, env={**os.environ, **self.spec.env}, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
        relay = asyncio.create_task(self._relay_lines(process))
        # Not process.wait(): it also waits until every holder of the output pipe (the
        # child's own children) has exited.
        while process.returncode is None:
            await asyncio.sleep(EXIT_POLL_S)
        _kill_group(process.pid)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(relay, DRAIN_S)
        return process.returncode

    async def _relay_lines(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        prefix = f"[{self.spec.name}] ".encode()
        async for line in process.stdout:
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


def _kill_group(pgid: int) -> None:
    """SIGKILL to what is left of a process group (nothing, usually)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
