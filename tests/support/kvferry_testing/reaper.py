"""Stops every process a test session started once the session's own process is gone.

Tests start servers, engine cores and their workers, and their fixtures stop them. A session
that is killed (a CI time limit, the out-of-memory killer, a second Ctrl-C) runs no
teardown: its children, re-parented, would run on and hold the machine's memory, enough to
sink the next run. `start` marks the session's environment with an id that every process
it starts inherits, and starts a reaper in a session of its own; once the test process has
ended, the reaper sends SIGKILL to every process whose environment carries that id.

    python -m kvferry_testing.reaper PID SESSION_ID    # what `start` runs
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

MARKER = "KVFERRY_TEST_SESSION"


def start() -> str:
    """Marks this process's environment and starts its reaper; returns the session id. A
    second call in the same process (a nested import) returns the first id."""
    if os.environ.get(MARKER, "").startswith(f"{os.getpid()}-"):
        return os.environ[MARKER]
    session = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    env = {k: v for k, v in os.environ.items() if k != MARKER}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    subprocess.Popen(
        [sys.executable, "-m", "kvferry_testing.reaper", str(os.getpid()), session],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=env, start_new_session=True, close_fds=True,
    )
    os.environ[MARKER] = session
    return session


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (None once it is gone): a pid reused by a
    later process has another."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def marked_processes(session: str) -> list[int]:
    """Pids of the processes whose environment carries `session`."""
    wanted = f"{MARKER}={session}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        if wanted in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def reap(pid: int, session: str, poll_s: float = 1.0) -> None:
    started = _start_time(pid)
    while started is not None and _start_time(pid) == started:
        time.sleep(poll_s)
    # Twice: a process may start another while the first sweep runs.
    for _ in range(2):
        for child in marked_processes(session):
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)


if __name__ == "__main__":
    reap(int(sys.argv[1]), sys.argv[2])
