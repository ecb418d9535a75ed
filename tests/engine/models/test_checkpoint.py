"""`check_checkpoint`: what loading would fail on, found without torch, one message each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.engine.models.checkpoint import CheckpointError, check_checkpoint


@pytest.fixture
def checkpoint(make_checkpoint, tmp_path: Path) -> Path:
    """A copy of a loadable checkpoint that a test may break."""
    copy = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint("Qwen2ForCausalLM"), copy)
    return copy


def test_a_loadable_checkpoint_passes_with_its_config(checkpoint: Path) -> None:
    assert check_checkpoint(checkpoint).architecture == "Qwen2ForCausalLM"


def test_a_sharded_checkpoint_passes(make_checkpoint) -> None:
    path = make_checkpoint("LlamaForCausalLM", sharded=True)
    assert len(list(path.glob("*.safetensors"))) > 1
    assert check_checkpoint(path).architecture == "LlamaForCausalLM"


def test_a_missing_directory_or_a_file_is_named(tmp_path: Path, checkpoint: Path) -> None:
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'absent'} does not exist$"):
        check_checkpoint(tmp_path / "absent")
    config = checkpoint / "config.json"
    with pytest.raises(CheckpointError, match=f"^{config} is not a directory$"):
        check_checkpoint(config)


def test_a_directory_without_config_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"^{tmp_path} has no config.json; is it an HF "
                                              "checkpoint directory\\?$"):
        check_checkpoint(tmp_path)


def test_an_architecture_the_engine_lacks_is_named_with_the_supported_ones(
        checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as caught:
        check_checkpoint(checkpoint)
    assert str(caught.value) == (
        f"{checkpoint / 'config.json'} names the architecture 'MambaForCausalLM', "
        "which the engine does not implement; supported: LlamaForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM, BartForConditionalGeneration, WhisperForConditionalGeneration")


def test_a_config_that_is_not_json_is_named(checkpoint: Path) -> None:
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=f"^{checkpoint / 'config.json'} is not valid JSON"):
        check_checkpoint(checkpoint)


def test_missing_weights_or_tokenizer_are_named(checkpoint: Path) -> None:
    (checkpoint / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=f"^{checkpoint} has no tokenizer.json; only "):
        check_checkpoint(checkpoint)
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=f"^{checkpoint} has neither model.safetensors nor "
                                              "model.safetensors.index.json"):
        check_checkpoint(checkpoint)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_unreadable_weights_are_named(checkpoint: Path) -> None:
    weights = checkpoint / "model.safetensors"
    weights.chmod(0)
    try:
        with pytest.raises(CheckpointError, match=f"^{weights} is not readable by this user$"):
            check_checkpoint(checkpoint)
    finally:
        weights.chmod(0o644)


def test_checking_imports_no_torch(checkpoint: Path) -> None:
    code = ("import sys; from pathlib import Path\n"
            "from kvferry.engine.models.checkpoint import check_checkpoint\n"
            f"check_checkpoint(Path({str(checkpoint)!r}))\n"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_tokenizer_from_elsewhere_is_not_looked_for(checkpoint: Path) -> None:
    (checkpoint / "tokenizer.json").unlink()
    assert check_checkpoint(checkpoint, has_own_tokenizer=False).architecture == \
        "Qwen2ForCausalLM"
