"""Run a command on a read-only filesystem with a few writable directories, as in a pod.

    unshare --mount [--user --map-root-user] python sandbox.py DIR... -- COMMAND...

In its own mount namespace (the caller's `unshare`), this binds each DIR onto itself, then
remounts every other mount read-only, except the kernel's (/proc, /sys, /dev, whose
/dev/shm a pod has writable too), checks that this worked, and executes COMMAND. Nothing
outside the namespace changes. A write anywhere but the DIRs then fails with EROFS, as
under a pod's `readOnlyRootFilesystem` with the DIRs as its volumes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Pseudo filesystems a container has anyway; a pod's /dev/shm is a writable volume.
KEPT_WRITABLE = ("/proc", "/sys", "/dev")
# The exit status when the filesystem could not be made read-only (the caller skips).
UNAVAILABLE = 97


def unshare_command() -> list[str]:
    """The `unshare` prefix that gives a child its own mount namespace, or [] if none can."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    # root may mount in a new mount namespace; anyone else needs a user namespace too.
    command = [unshare, "--mount", "--propagation", "private"]
    return command if os.geteuid() == 0 else [*command, "--user", "--map-root-user"]


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            # Field 5 is the mount point, with spaces and the like octal-escaped (\040).
            raw = line.split()[4]
            points.append(raw.encode().decode("unicode_escape"))
    return points


def _is_under(path: str, roots: tuple[str, ...] | list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _writable(directory: str) -> bool:
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def _fail(message: str) -> None:
    print(f"sandbox: {message}", file=sys.stderr, flush=True)
    sys.exit(UNAVAILABLE)


def main(argv: list[str]) -> None:
    if "--" not in argv:
        _fail("usage: sandbox.py DIR... -- COMMAND...")
    split = argv.index("--")
    writable, command = [os.path.abspath(d) for d in argv[:split]], argv[split + 1:]
    for directory in writable:
        subprocess.run(["mount", "--bind", directory, directory], check=True)
    for point in _mount_points():
        if _is_under(point, KEPT_WRITABLE) or point in writable:
            continue
        # A mount this namespace may not change (one its owner locked) stays as it is; the
        # check below finds out whether that leaves anything writable that matters.
        subprocess.run(["mount", "-o", "remount,bind,ro", point], capture_output=True, check=False)
    for directory in writable:
        if not _writable(directory):
            _fail(f"{directory} should be writable and is not")
    for directory in {str(Path(d).parent) for d in writable} | {os.environ.get("HOME", "/")}:
        if _writable(directory):
            _fail(f"{directory} is still writable: the filesystem could not be made read-only")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
