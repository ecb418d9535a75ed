"""benchmarks/gpu_engine.py runs end to end on a tiny model where there is no GPU (its
figures there mean nothing; on a GPU the device check runs it at full size)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_engine.py"


def test_the_gpu_engine_benchmark_runs_and_reports_every_figure(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(BENCHMARK), "--smoke", "--device", "cpu"],
                            capture_output=True, text=True, timeout=600, check=False,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["smoke"] is True and figures["device"].startswith("cpu")
    for name in ("tok_s", "hf_tok_s", "server_tok_s", "decode_step_ms", "floor_ms",
                 "copy_gbps"):
        assert figures[name] > 0, name
    # Ratios of the unrounded figures: within rounding of the printed ones.
    assert figures["ratio_vs_hf"] == pytest.approx(figures["tok_s"] / figures["hf_tok_s"],
                                                   rel=0.01)
    assert figures["floor_ratio"] == pytest.approx(
        figures["decode_step_ms"] / figures["floor_ms"], rel=0.02)
    assert figures["server_ratio"] == pytest.approx(
        figures["server_tok_s"] / figures["tok_s"], rel=0.01)
    assert figures["gpu_busy"] is None  # only measured on CUDA
    assert set(figures["targets"]) == {"tok_s", "ratio_vs_hf", "floor_ratio", "gpu_busy",
                                       "server_ratio"}
