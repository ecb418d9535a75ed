"""What a checkpoint directory must hold for the engine to load it, checked without torch.

The engine reads `config.json` (an architecture it implements), the safetensors weights
(`model.safetensors`, or the shards an index names) and `tokenizer.json`. `check_checkpoint`
looks for each of them the way loading would, so that a command that starts engines
(`kvferry up`) can refuse a wrong model source at once, with one message, instead of
starting processes that fail one after the other.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.models.registry import SUPPORTED_ARCHITECTURES

TOKENIZER_FILE = "tokenizer.json"


class CheckpointError(ValueError):
    """A checkpoint directory the engine cannot load; the message names the path and why."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's shards, or `model.safetensors`."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        with index_path.open(encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(p.name) for p in files if not p.is_file()]
        if absent:
            raise ValueError(f"{index_path} names shard files that do not exist: {absent}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(
        f"{model_dir} has neither model.safetensors nor model.safetensors.index.json; "
        "only safetensors checkpoints are supported"
    )


def check_checkpoint(model_dir: Path, has_own_tokenizer: bool = True) -> ModelArchConfig:
    """The checkpoint's architecture config, once every file loading needs is found readable.

    CheckpointError names the first thing missing or wrong: the directory itself, its
    `config.json`, an architecture the engine does not implement, the weights or (unless
    `has_own_tokenizer` is False: the tokenizer comes from elsewhere) the tokenizer.
    """
    model_dir = Path(model_dir)
    _check_directory(model_dir)
    try:
        config = ModelArchConfig.from_pretrained(model_dir)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{model_dir / 'config.json'} is not valid JSON: {exc}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(str(exc)) from None
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{model_dir / 'config.json'} names the architecture {config.architecture!r}, "
            f"which the engine does not implement; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        files = checkpoint_files(model_dir)
    except (OSError, ValueError) as exc:
        raise CheckpointError(str(exc)) from None
    tokenizer = model_dir / TOKENIZER_FILE
    if has_own_tokenizer and not tokenizer.is_file():
        raise CheckpointError(f"{model_dir} has no {TOKENIZER_FILE}; only tokenizers-library "
                              "(fast) tokenizers are supported")
    needed = [*files, tokenizer] if has_own_tokenizer else files
    unreadable = [p for p in needed if not os.access(p, os.R_OK)]
    if unreadable:
        raise CheckpointError(f"{unreadable[0]} is not readable by this user")
    return config


def _check_directory(model_dir: Path) -> None:
    if not model_dir.exists():
        raise CheckpointError(f"{model_dir} does not exist")
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir} is not a directory")
    if not os.access(model_dir, os.R_OK | os.X_OK):
        raise CheckpointError(f"{model_dir} is not readable by this user")
    config = model_dir / "config.json"
    if config.is_file() and not os.access(config, os.R_OK):
        raise CheckpointError(f"{config} is not readable by this user")
