"""The Triton attention backend: slot-mapped paged kernels for the whole flat batch.

Each layer's step is two launches: `reshape_and_cache` writes the new keys and values at
their slots, then `unified_attention` runs prefills, chunked prefills and decodes together
over the block table (split-KV for few long decodes). On a GPU the kernels are compiled;
on CPU tensors they run only under Triton's interpreter (`TRITON_INTERPRET=1`, set before
the kernels are first imported).
"""

from __future__ import annotations

import torch
from kvferry.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionType,
    KVCacheView,
)
from kvferry.engine.attention.triton.reshape_and_cache import reshape_and_cache
from kvferry.engine.attention.triton.unified_attention import unified_attention


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in two Triton launches per layer; same contract as the torch backend."""

    name = "triton"

    def __init__(self, num_kv_splits: int | None = None) -> None:
        # None: split-KV chosen per step by a heuristic; 1: never; n > 1: always n ranges.
        self._num_kv_splits = num_kv_splits

    def forward(
        self,
        query: torch.Tensor,  # (num_tokens, num_heads, head_size)
        key: torch.Tensor | None,  # (num_tokens, num_kv_heads, head_size)
        value: torch.Tensor | None,  # (num_tokens, num_kv_heads, head_size)
        kv_cache: KVCacheView | None,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_size)
        """Stores `key`/`value` at `metadata.slot_mapping`, then attends (see the interface).

        Rows past `metadata.num_actual_tokens` (padding) are neither written to the cache
        nor computed; their output rows are left unset.
        """
        if metadata.attn_type is AttentionType.ENCODER:
            raise NotImplementedError("encoder self-attention in the Triton backend")
        assert kv_cache is not None
        key_cache, value_cache = kv_cache
        num_tokens = metadata.num_actual_tokens
        if metadata.attn_type is AttentionType.DECODER:
            assert key is not None and value is not None
            reshape_and_cache(
                key[:num_tokens],
                value[:num_tokens],
                key_cache,
                value_cache,
                metadata.slot_mapping[:num_tokens],
            )
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        unified_attention(
            query[:num_tokens],
            key_cache,
            value_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            scale,
            causal=metadata.is_causal,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            num_kv_splits=self._num_kv_splits,
            out=output[:num_tokens],
        )
        return output

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCacheView,
        slot_mapping: torch.Tensor,
    ) -> None:
        reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping)
