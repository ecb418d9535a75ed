"""benchmarks/serving.py end to end on a tiny model: a ShareGPT file in, every request
served, figures, JSON and the latency plot out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "serving.py"


def test_serving_benchmark_quick_run_with_a_sharegpt_file(tmp_path: Path) -> None:
    conversations = [
        {"conversations": [{"from": "human", "value": " ".join(["tok5"] * (4 + i))},
                           {"from": "gpt", "value": " ".join(["tok9"] * (6 + i))}]}
        for i in range(12)
    ] + [{"conversations": [{"from": "human", "value": "alone"}]}]  # no reply: skipped
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick", "--dataset", str(dataset),
         "--num-requests", "10", "--request-rates", "20,inf",
         "--output-json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "out.png")],
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["num_requests"] == 10 and summary["num_failed"] == 0
    assert summary["ratio"] > 0 and summary["offline_tokens_per_s"] > 0
    report = json.loads((tmp_path / "out.json").read_text())
    assert [r["request_rate"] for r in report["runs"]] == [20.0, "inf"]
    for run in report["runs"]:
        assert run["num_requests"] == 10 and run["num_failed"] == 0
        assert run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"]
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
