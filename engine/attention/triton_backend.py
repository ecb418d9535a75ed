"""The Triton attention backend: slot-mapped paged kernels for the whole flat batch.

Each decoder layer's step is two launches: `reshape_and_cache` writes the new keys and
values at their slots, then `unified_attention` runs prefills, chunked prefills and decodes
together over the block table (split-KV for few long decodes). Cross-attention is the
second launch alone, non-causal over the cross block table; encoder self-attention is one
`encoder_attention` launch (the same kernel reading the step's own keys in place), with no
cache at all. On a GPU the kernels are compiled;
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
from kvferry.engine.attention.triton.encoder_attention import encoder_attention
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
        """Stores `key`/`value` at `metadata.slot_mapping`, then attends (see the interface):
        DECODER writes then attends causally, CROSS only attends over the cached keys,
        ENCODER attends over `key`/`value` themselves and never touches `kv_cache`.

        Rows past `metadata.num_actual_tokens` (padding) are neither written to the cache
        nor computed; their output rows are left unset.
        """
        num_tokens = metadata.num_actual_tokens
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        attn_type = metadata.attn_type
        if attn_type is not AttentionType.CROSS and (key is None or value is None):
            raise ValueError(f"{attn_type.value} attention needs the step's keys and values")
        if attn_type is AttentionType.ENCODER:
            encoder_attention(
                query[:num_tokens],
                key[:num_tokens],
                value[:num_tokens],
                metadata.query_start_loc,
                scale,
                max_query_len=metadata.max_query_len,
                num_kv_splits=self._num_kv_splits,
                out=output[:num_tokens],
            )
            return output
        if kv_cache is None:
            raise ValueError(f"{attn_type.value} attention needs the layer's KV cache")
        key_cache, value_cache = kv_cache
        if attn_type is AttentionType.DECODER:
            reshape_and_cache(
                key[:num_tokens],
                value[:num_tokens],
                key_cache,
                value_cache,
                metadata.slot_mapping[:num_tokens],
            )
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
