"""The CPU runner's glibc malloc settings."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from kvferry.engine.runner.cpu_malloc import keep_activation_memory
print(keep_activation_memory(), keep_activation_memory())
"""


def test_settings_apply_once_per_process() -> None:
    # A fresh interpreter: the settings are process-wide and applied at most once.
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], check=True, capture_output=True, text=True
    ).stdout.splitlines()
    assert out == ["glibc malloc: mmap threshold 32 MiB, trim threshold 1024 MiB", "True True"]
