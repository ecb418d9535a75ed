"""The `kvferry` command line, run as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

from kvferry import LLM, SamplingParams


def _kvferry(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvferry.cli", *args],
        capture_output=True, text=True, timeout=300,
    )


def test_help_lists_subcommands_without_importing_torch() -> None:
    code = (
        "import sys; from kvferry.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "generate" in result.stdout and "operator" in result.stdout
    assert result.stdout.strip().endswith("False")


def test_generate_prints_the_same_tokens_as_the_offline_api(make_checkpoint) -> None:
    path = make_checkpoint("LlamaForCausalLM")
    result = _kvferry(
        "generate", "--model", str(path), "--prompt", "w5 w6 w7", "--prompt", "w9",
        "--max-tokens", "5", "--ignore-eos", "--json", "--num-gpu-blocks-override", "32",
        "--max-model-len", "256",
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    llm = LLM(model=str(path), max_model_len=256, num_gpu_blocks_override=32)
    expected = llm.generate(
        ["w5 w6 w7", "w9"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    assert [line["prompt"] for line in lines] == ["w5 w6 w7", "w9"]
    for line, out in zip(lines, expected):
        assert line["completions"][0]["token_ids"] == out.outputs[0].token_ids
        assert line["completions"][0]["text"] == out.outputs[0].text
        assert line["completions"][0]["finish_reason"] == "length"


def test_generate_reports_bad_input_as_a_message(make_checkpoint) -> None:
    path = make_checkpoint("LlamaForCausalLM")
    result = _kvferry("generate", "--model", str(path), "--prompt", "w5", "--top-p", "2")
    assert result.returncode == 2
    assert "kvferry generate: error: top_p must be in (0, 1], got 2.0" in result.stderr
    result = _kvferry("generate", "--model", str(path), "--prompt", "w5",
                      "--max-model-len", "999999")
    assert result.returncode == 2
    assert "max_model_len 999999 is larger than the model's max_position_embeddings" in (
        result.stderr
    )
    missing = _kvferry("generate", "--model", "/nonexistent/ckpt", "--prompt", "x")
    assert missing.returncode == 2
    assert "Traceback" not in missing.stderr
