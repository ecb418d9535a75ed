"""benchmarks/structured.py end to end on a tiny model: every constrained output validates,
both passes generate the same tokens, and the figures and the mask timings come out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "structured.py"


def test_structured_benchmark_quick_run(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(BENCHMARK), "--quick"], capture_output=True,
                            text=True, timeout=900, check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["valid_outputs"] == summary["num_requests"] == 16
    assert summary["ratio"] > 0 and summary["target"] == 0.9
    assert summary["constrained_tokens_per_s"] > 0 and summary["unconstrained_tokens_per_s"] > 0
    # The steps of the warm passes had masks to wait for (each a fill of real rows).
    assert summary["mask_wait_ms_per_step"] > 0
    masks = summary["mask_batch64"]
    assert masks["steps"] == 50 and 0 < masks["mask_ms_median"] <= masks["mask_ms_p90"]
    assert summary["grammar_engine"] == "llguidance"
    assert set(summary["compile_ms"]) == {"tokenizer_setup", "schema_0", "schema_1", "schema_2",
                                          "schema_3"}
