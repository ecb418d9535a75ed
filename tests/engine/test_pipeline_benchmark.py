"""benchmarks/pipeline.py runs end to end on a short workload and reports both loops at
P = 2 and 4 (the ratios are figures for the note, never asserted as timings here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "pipeline.py"


def test_the_pipeline_benchmark_reports_both_loops_at_two_and_four_stages(
    tmp_path: Path,
) -> None:
    result = subprocess.run([sys.executable, str(BENCHMARK), "--quick", "--stage-ms", "2"],
                            capture_output=True, text=True, timeout=600, check=False,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for p in (2, 4):
        assert figures[f"ratio_p{p}"] > 0 and figures[f"tok_s_p{p}"] > 0
        assert figures[f"sync_tok_s_p{p}"] > 0 and 0 <= figures[f"bubble_p{p}"] < 1
        assert f"P={p}: synchronous" in result.stdout and f"{p} in flight at most" in result.stdout
