"""`kvferry up`'s supervisor: a child that dies takes its process group with it and restarts
with backoff; one that never becomes ready is given up on after three starts."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from pathlib import Path

import pytest

from kvferry import supervisor
from kvferry.supervisor import Child, ChildSpec, GaveUp, error_lines, http_probe, tcp_probe

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
    assert "[pod-0] exited with 3 after it was ready; restarting in 1 s (at " in out
    # The first run's grandchild was killed with its group, long before its minute was up.
    assert not is_alive(grandchildren[0])
    for pid in grandchildren[1:]:
        deadline = time.monotonic() + 10
        while is_alive(pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)


# Counts its starts in a file, says why it fails (after some noise), and exits with 4.
FAILING = """
import sys
with open(sys.argv[1], "a") as starts:
    starts.write("start\\n")
print("loading the model", flush=True)
print("ERROR the model is broken", flush=True)
print("the last words", flush=True)
sys.exit(4)
"""


async def _never_ready() -> bool:
    return False


def test_a_child_never_ready_is_given_up_on_after_three_starts(tmp_path: Path, capfd) -> None:
    starts = tmp_path / "starts"

    async def scenario() -> tuple[GaveUp, float]:
        stopping = asyncio.Event()
        gave_up: asyncio.Future[GaveUp] = asyncio.get_running_loop().create_future()
        child = Child(ChildSpec("pod-0", [sys.executable, "-c", FAILING, str(starts)],
                                is_ready=_never_ready), stopping, gave_up.set_result)
        began = time.monotonic()
        child.start()
        account = await asyncio.wait_for(gave_up, 30)
        elapsed = time.monotonic() - began
        await child.stop(timeout_s=5)
        return account, elapsed

    account, elapsed = asyncio.run(scenario())
    assert starts.read_text().split() == ["start"] * 3
    assert account == GaveUp("pod-0", 4, 3, ["ERROR the model is broken", "the last words"])
    assert account.describe() == (
        "pod-0 exited 3 times in a row before it was ready (last exit status 4); its last "
        "lines:\n  ERROR the model is broken\n  the last words")
    # Backoff between the tries: 1 s, then 2 s.
    assert 3.0 <= elapsed < 15.0
    out = capfd.readouterr().out
    assert "[pod-0] exited with 4 before it was ever ready (1 of 3); restarting in 1 s" in out
    assert "[pod-0] exited with 4 before it was ever ready (2 of 3); restarting in 2 s" in out
    assert "[pod-0] exited with 4 before it was ready, 3 times in a row; not restarting it" in out


# Ready at once (the probe is a file it creates), then exits with 5.
READY_THEN_DIES = """
import pathlib, sys
pathlib.Path(sys.argv[1]).write_text("ready")
sys.exit(5)
"""


def test_a_child_that_was_ready_restarts_with_doubling_backoff_up_to_the_cap(
        tmp_path: Path, capfd, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "BACKOFF_INITIAL_S", 0.05)
    monkeypatch.setattr(supervisor, "BACKOFF_MAX_S", 0.2)
    monkeypatch.setattr(supervisor, "READY_POLL_S", 0.01)
    marker = tmp_path / "ready"

    async def is_ready() -> bool:
        return marker.exists()

    async def scenario() -> int:
        stopping = asyncio.Event()
        gave_up: list[GaveUp] = []
        child = Child(ChildSpec("pod-0", [sys.executable, "-c", READY_THEN_DIES, str(marker)],
                                is_ready=is_ready), stopping, gave_up.append)
        child.start()
        deadline = time.monotonic() + 60
        while child.num_restarts < 6:
            assert time.monotonic() < deadline, capfd.readouterr().out
            await asyncio.sleep(0.01)
        stopping.set()
        await child.stop(timeout_s=5)
        assert gave_up == []
        return child.num_restarts

    asyncio.run(scenario())
    out = capfd.readouterr().out
    delays = [float(d) for d in re.findall(r"restarting in (\S+) s \(at \d\d:\d\d:\d\d\)", out)]
    assert delays[:6] == [0.05, 0.1, 0.2, 0.2, 0.2, 0.2]
    # Ready in its first run, it is never given up on, however often it dies later.
    assert out.count("exited with 5 after it was ready") + \
        out.count("exited with 5 before it was ready again") == len(delays)


def test_a_stopping_run_ends_a_backoff_wait_at_once(capfd, monkeypatch: pytest.MonkeyPatch
                                                    ) -> None:
    monkeypatch.setattr(supervisor, "BACKOFF_INITIAL_S", 60.0)

    async def scenario() -> float:
        stopping = asyncio.Event()
        child = Child(ChildSpec("pod-0", [sys.executable, "-c", "raise SystemExit(1)"]),
                      stopping)
        child.start()
        while child.num_restarts < 1:
            await asyncio.sleep(0.01)
        began = time.monotonic()
        stopping.set()
        await child.stop(timeout_s=5)
        return time.monotonic() - began

    assert asyncio.run(scenario()) < 1.0
    assert "restarting in 60 s" in capfd.readouterr().out


def test_error_lines_start_at_the_first_error() -> None:
    lines = ["INFO loading", "Traceback (most recent call last):", "  File x", "ValueError: y"]
    assert error_lines(lines) == lines[1:]
    assert error_lines(["kvferry serve: error: bad flag"]) == ["kvferry serve: error: bad flag"]
    assert error_lines(["INFO a", "INFO b"]) == ["INFO a", "INFO b"]


def test_probes_pass_only_when_the_server_answers(tmp_path: Path) -> None:
    async def scenario() -> list[bool]:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            request = await reader.readuntil(b"\r\n\r\n")
            status = b"200 OK" if request.startswith(b"GET /health ") else b"503 Loading"
            writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            results = [await http_probe("127.0.0.1", port, "/health")(),
                       await http_probe("127.0.0.1", port, "/loading")(),
                       await tcp_probe("127.0.0.1", port)()]
        # Nothing listens there any more.
        results += [await http_probe("127.0.0.1", port, "/health")(),
                    await tcp_probe("127.0.0.1", port)()]
        return results

    assert asyncio.run(scenario()) == [True, False, True, False, False]
