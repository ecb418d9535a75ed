"""benchmarks/step_overhead.py runs end to end on a short workload and reports every figure,
both loops against its simulated device included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "step_overhead.py"


def test_the_step_overhead_benchmark_reports_the_host_step_with_and_without_overlap(
    tmp_path: Path,
) -> None:
    # A device step far longer than the host's: async scheduling hides the host's work,
    # the synchronous loop adds it to every step.
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--steps", "30", "--warmup-steps", "30",
         "--device-ms", "5"],
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for name in ("ms_per_step", "sync_host_ms", "async_host_ms", "sync_step_ms",
                 "async_step_ms"):
        assert figures[name] > 0, name
    assert figures["device_ms"] == 5
    assert figures["overlap_ratio"] == pytest.approx(
        figures["sync_step_ms"] / figures["async_step_ms"], rel=0.01)
    # The synchronous loop's device waits for all of the host's work every step.
    assert figures["sync_step_ms"] >= figures["device_ms"] + 0.9 * figures["sync_host_ms"]
    assert figures["async_device_idle_ms"] < figures["sync_device_idle_ms"]
    assert "async scheduling:" in result.stdout
