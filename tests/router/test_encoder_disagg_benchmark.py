"""benchmarks/encoder_disagg.py end to end on a tiny Whisper: both services start under
`kvferry up`, every streamed transcription completes, and the figures come out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "encoder_disagg.py"


def test_encoder_disagg_benchmark_quick_run(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(BENCHMARK), "--quick", "--pin", "--png",
                             str(tmp_path / "plot.png")], capture_output=True, text=True,
                            timeout=900, check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    for name in ("colocated", "disaggregated"):
        (row,) = summary[name]
        assert row["completed"] == 4 and row["ttft_p99"] > 0
    assert summary["pull_ms"] > 0 and summary["encode_ms"] > 0
    assert summary["ratio"] > 0 and summary["pull_over_encode"] > 0
    assert (tmp_path / "plot.png").stat().st_size > 0
    # Each pod's server and engine-core processes, onto its core.
    assert summary["pinned"] is True and len(summary["pinned_processes"]) == 4
    assert all(n >= 2 for n in summary["pinned_processes"].values()), summary
