"""benchmarks/router.py end to end, briefly: kvferry's router and vllm-router in front of the
same fake pods, each against the direct path, and the ratio between the two routers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "router.py"
RATIOS = ("kvferry_over_vllm_router", "keyed_over_unkeyed")


def test_router_benchmark_measures_vllm_router_beside_kvferry(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--seconds", "0.3", "--pods", "2", "--streams", "1", "4",
         "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert sorted(summary["ratio_vs_vllm_router"]) == ["1", "4"]
    for streams, row in summary["by_streams"].items():
        assert sorted(k for k in row if k not in RATIOS) == [
            "direct", "kvferry", "kvferry-keyed", "vllm-router"]
        for path in ("kvferry", "kvferry-keyed", "vllm-router"):
            assert row[path]["rps"] > 0 and "added_p50_ms" in row[path]
        expected = row["kvferry"]["rps"] / row["vllm-router"]["rps"]
        assert summary["ratio_vs_vllm_router"][streams] == expected
        keyed = row["kvferry-keyed"]["rps"] / row["kvferry"]["rps"]
        assert summary["keyed_over_unkeyed"][streams] == keyed
    assert summary["vllm_router_added_p50_ms_1_stream"] == (
        summary["by_streams"]["1"]["vllm-router"]["added_p50_ms"])
    assert any("kvferry req/s / vllm-router req/s" in line for line in lines[:-1])
    assert any("kvferry keyed req/s / unkeyed req/s" in line for line in lines[:-1])
