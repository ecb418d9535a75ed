"""`kvferry up`'s supervisor: a child that dies takes its process group with it and restarts."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from kvferry.supervisor import Child, ChildSpec

# Starts a grandchild that keeps the output pipe open for a minute, then exits with 3 (a pod
# server whose engine core outlives it).
PARENT = """
import subprocess, sys
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "a").write(f"{grandchild.pid}\\n")
print("started", flush=True)
sys.exit(3)
"""


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited: it only waits for its parent to read its status.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_dead_child_takes_its_group_along_and_restarts(tmp_path: Path, capfd) -> None:
    pids_file = tmp_path / "pids"

    async def scenario() -> list[int]:
        stopping = asyncio.Event()
        child = Child(ChildSpec("pod-0", [sys.executable, "-c", PARENT, str(pids_file)]),
                      stopping)
        child.start()
        deadline = time.monotonic() + 30
        while child.num_restarts < 1:
            assert time.monotonic() < deadline, capfd.readouterr().out
            await asyncio.sleep(0.05)
        stopping.set()
        await child.stop(timeout_s=10)
        return [int(line) for line in pids_file.read_text().split()]

    grandchildren = asyncio.run(scenario())

    out = capfd.readouterr().out
    assert "[pod-0] started" in out
    assert "[pod-0] exited with 3; restarting" in out
    # The first run's grandchild was killed with its group, long before its minute was up.
    assert not is_alive(grandchildren[0])
    for pid in grandchildren[1:]:
        deadline = time.monotonic() + 10
        while is_alive(pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
