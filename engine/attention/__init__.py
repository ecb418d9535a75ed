"""Attention backends: one interface, a torch reference backend (the CPU path) and Triton kernels."""

from __future__ import annotations

import logging
import os

import torch
from kvferry.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionType,
    KVCacheView,
)

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionType", "KVCacheView",
           "get_attention_backend", "resolve_attention_backend"]

logger = logging.getLogger(__name__)


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend `name` means on `device`: `auto` is Triton on a GPU, torch elsewhere.

    ValueError when Triton cannot run there: not installed, or CPU tensors without the
    interpreter (TRITON_INTERPRET=1 in the environment before the engine starts).
    """
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return "torch"  # decided without importing Triton (slow to import, unused on CPU)
    from kvferry.engine.attention.triton import HAS_TRITON

    if name == "auto":
        return "triton" if HAS_TRITON else "torch"
    if name != "triton":
        raise ValueError(f"unknown attention backend {name!r}; supported: auto, torch, triton")
    if not HAS_TRITON:
        raise ValueError("attention backend 'triton' needs the triton package (pip install triton)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention backend 'triton' on CPU runs only under Triton's interpreter: set "
            "TRITON_INTERPRET=1 before starting the engine, or use --attention-backend torch")
    return name


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend `name` (`auto`, `torch` or `triton`) for an engine on `device`."""
    resolved = resolve_attention_backend(name, device)
    logger.info("attention backend: %s%s", resolved, " (auto)" if name == "auto" else "")
    if resolved == "triton":
        from kvferry.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from kvferry.engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
