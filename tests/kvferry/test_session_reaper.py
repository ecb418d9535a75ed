"""The test session's reaper (tests/support/kvferry_testing/reaper.py): once the session's
process is killed, every process it started, children and their children, is stopped; a
process of another session is left alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kvferry_testing.procs import support_env

SESSION = textwrap.dedent("""
    import subprocess, sys, time
    from kvferry_testing import reaper

    reaper.start()
    sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
    child = subprocess.Popen(sleep)
    # A child that starts one of its own in a new session (as servers' engine cores are).
    starter = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], "
         "start_new_session=True); print(p.pid, flush=True); time.sleep(300)"],
        stdout=subprocess.PIPE)
    grandchild = int(starter.stdout.readline())
    print(child.pid, starter.pid, grandchild, flush=True)
    time.sleep(300)
""")


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a killed child nobody waited for yet is a zombie


def test_a_killed_session_leaves_no_process_running(tmp_path: Path) -> None:
    script = tmp_path / "session.py"
    script.write_text(SESSION)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env=support_env())
    session = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                               env=support_env())
    try:
        assert session.stdout is not None
        pids = [int(p) for p in session.stdout.readline().split()]
        assert len(pids) == 3 and all(_running(p) for p in pids)
        session.kill()
        session.wait(10)
        deadline = time.monotonic() + 15
        while any(_running(p) for p in pids):
            assert time.monotonic() < deadline, [p for p in pids if _running(p)]
            time.sleep(0.1)
        # This test's own session marks its children too: another id, not reaped.
        assert _running(other.pid)
    finally:
        other.kill()
        other.wait()
        for pid in pids if "pids" in locals() else []:
            subprocess.run(["kill", "-9", str(pid)], check=False, capture_output=True)
