"""Decoder-only model definitions (Llama, Qwen2, Qwen3), their config, loader and sources.

`load_model` and `resolve_dtype` import torch, so they are resolved on first access;
reading a config or resolving a model source does not need torch.
"""

from __future__ import annotations

from typing import Any

from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.models.registry import SUPPORTED_ARCHITECTURES, get_model_class
from kvferry.engine.models.source import resolve_model_source

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelArchConfig",
    "get_model_class",
    "load_model",
    "resolve_dtype",
    "resolve_model_source",
]


def __getattr__(name: str) -> Any:
    if name in ("load_model", "resolve_dtype"):
        from kvferry.engine.models import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
