"""benchmarks/encdec_throughput.py end to end on a tiny Whisper: both engines transcribe
every request with the asked lengths and the same greedy tokens, and the figures come out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "encdec_throughput.py"


def test_encdec_benchmark_quick_run(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(BENCHMARK), "--quick"], capture_output=True,
                            text=True, timeout=900, check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["num_requests"] == summary["identical_outputs"] == 6
    assert summary["ratio"] > 0 and summary["target_ratio"] == 3.0
    assert 0 < summary["kvferry_encoder_seconds"] < summary["kvferry_seconds"]
    assert summary["ratio_ceiling"] > 0
