"""The demo checkpoint (deterministic, loadable, HF-compatible) and model sources."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvferry.engine.attention.torch_backend import TorchAttentionBackend
from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.models.demo import EOS_ID, create_demo_checkpoint
from kvferry.engine.models.loader import load_model
from kvferry.engine.models.source import resolve_model_source

DEMO_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt")


def test_demo_is_byte_identical_across_processes(demo_dir, tmp_path):
    # A fresh interpreter catches anything seeded per process (hash seeds, Rust maps).
    other = tmp_path / "again"
    code = (
        "import sys; from pathlib import Path; "
        "from kvferry.engine.models.demo import create_demo_checkpoint; "
        "create_demo_checkpoint(Path(sys.argv[1]))"
    )
    subprocess.run([sys.executable, "-c", code, str(other)], check=True)
    assert sorted(p.name for p in demo_dir.iterdir()) == DEMO_FILES
    for name in DEMO_FILES:
        assert (demo_dir / name).read_bytes() == (other / name).read_bytes(), name


def test_demo_config(demo_dir):
    config = ModelArchConfig.from_pretrained(demo_dir)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        4,
        256,
        8,
        2,
    )
    assert config.vocab_size == 2048
    assert config.eos_token_ids == [EOS_ID]


def test_demo_loads_and_matches_hf(demo_dir, hf_logits, paged_run):
    model = load_model(demo_dir, torch.float32, TorchAttentionBackend(), torch.device("cpu"))
    prompts = [[1, 50, 300, 7, 1999], [1, 4]]
    run = paged_run(model, num_reqs=2, max_len=8)
    for prompt, logits in zip(prompts, run.step(prompts)):
        torch.testing.assert_close(logits, hf_logits(demo_dir, prompt), atol=1e-4, rtol=0)


def test_source_local_directory(demo_dir):
    assert resolve_model_source(str(demo_dir)) == demo_dir


def test_source_demo_is_created_once(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFERRY_CACHE", str(tmp_path / "cache"))
    first = resolve_model_source("demo")
    assert first.parent == tmp_path / "cache"
    assert (first / "model.safetensors").is_file()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = resolve_model_source("demo")
    assert again == first
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp
    # No temporary directories are left behind.
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]


def test_source_demo_explicit_cache_dir(tmp_path):
    path = resolve_model_source("demo", cache_dir=tmp_path)
    assert path.parent == tmp_path
    assert (path / "tokenizer.json").is_file()


def test_source_missing_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"model path '.*nope' does not exist"):
        resolve_model_source(missing)


def test_source_hub_id_without_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ValueError,
        match=r"'org/model' is not an existing directory; a hub id "
        r"needs huggingface_hub and network access",
    ):
        resolve_model_source("org/model")
