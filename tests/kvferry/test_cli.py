"""The `kvferry` command line, run as a user runs it (a subprocess)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

import kvferry
from kvferry import LLM, SamplingParams
from kvferry.cli import SUBCOMMANDS, build_parser


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


def test_version_prints_the_release() -> None:
    done = _kvferry("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"kvferry {kvferry.__version__}\n"


def _options(command: str) -> list[argparse.Action]:
    parser = build_parser([command])
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [a for a in subparsers.choices[command]._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_option_says_what_it_is_and_its_default(command: str) -> None:
    """Flags (off unless given) say what they do; every other option that is not required
    also says its default, as argparse renders it or in words."""
    silent = [a.option_strings[0] for a in _options(command)
              if not (a.help or "").strip() or a.help.startswith("(default")]
    assert silent == []
    no_default = [a.option_strings[0] for a in _options(command)
                  if a.nargs != 0 and not a.required and "default" not in a.help]
    assert no_default == []


def test_help_renders_the_defaults_values() -> None:
    done = _kvferry("up", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "the router's port (default: 8000; with --once, a free one)" in text
    assert "longest wait for every pod to be ready (default: 600.0)" in text


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


def test_up_gives_pods_ports_outside_the_ephemeral_range() -> None:
    """A pod's port stays its own until it binds it (and at each restart): no socket bound
    to port 0 meanwhile, such as a NIXL agent's UCX listener, can take it."""
    import socket

    from kvferry.up import STABLE_PORTS_FROM, ephemeral_ports, free_port

    low, high = ephemeral_ports()
    assert low < high
    for _ in range(20):
        port = free_port()
        assert STABLE_PORTS_FROM <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
