"""Attention backends: one interface, a torch reference backend (the CPU path) and Triton kernels."""

from kvferry.engine.attention.backend import AttentionBackend, AttentionMetadata, KVCacheView

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCacheView", "get_attention_backend"]


def get_attention_backend(name: str) -> AttentionBackend:
    """Returns the backend called `name` (`torch`)."""
    if name == "torch":
        from kvferry.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; supported: ['torch']")
