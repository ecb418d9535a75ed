"""The torch attention backend: the CPU path and the reference for the Triton kernels.

A step's batch mixes decodes (one query token) and prefills (many, possibly on top of a
cached prefix). Decodes run together as one padded batched attention over keys gathered
through the block table; each prefill runs as one `scaled_dot_product_attention` call
with a causal mask shifted by its cached prefix length.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kvferry.engine.attention.backend import AttentionBackend, AttentionMetadata, KVCacheView


def write_kv_to_cache(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    kv_cache: KVCacheView,
    slot_mapping: torch.Tensor,  # (num_tokens,) int64
) -> None:
    """Stores each token's key and value at its slot (`block * block_size + offset`)."""
    key_cache, value_cache = kv_cache
    block_size = key_cache.shape[1]
    # The per-layer views are strided (layers sit between blocks), so slots cannot be
    # flattened into one axis; address them as (block, offset) pairs instead.
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


def gather_kv(
    kv_cache: KVCacheView,
    block_ids: torch.Tensor,  # (num_seqs, num_blocks) int32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns keys and values of `block_ids`, each (num_seqs, num_blocks * block_size, H, D)."""
    key_cache, value_cache = kv_cache
    num_seqs, num_blocks = block_ids.shape
    idx = block_ids.long()
    keys = key_cache[idx].reshape(num_seqs, num_blocks * key_cache.shape[1], *key_cache.shape[2:])
    values = value_cache[idx].reshape(keys.shape)
    return keys, values


class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain torch ops; exact enough to compare with HF in float32."""

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCacheView,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        write_kv_to_cache(key[:num_tokens], value[:num_tokens], kv_cache, metadata.slot_mapping)
        output = torch.empty_like(query)
        query_lens = metadata.query_lens_np
        is_decode = query_lens == 1 if metadata.causal else np.zeros_like(query_lens, dtype=bool)
        decode_rows = np.flatnonzero(is_decode)
        if decode_rows.size:
            self._decode(query, kv_cache, metadata, decode_rows, scale, output)
        for row in np.flatnonzero(~is_decode):
            self._prefill(query, kv_cache, metadata, int(row), scale, output)
        return output

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: KVCacheView,
        metadata: AttentionMetadata,
        rows: np.ndarray,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        """One query token per row: batched attention over keys padded to the longest row."""
        block_size = kv_cache[0].shape[1]
        seq_lens_np = metadata.seq_lens_np[rows]
        num_blocks = int(-(-seq_lens_np.max() // block_size))
        rows_t = torch.from_numpy(rows)
        token_idx = torch.from_numpy(metadata.query_start_loc_np[rows]).long()
        keys, values = gather_kv(kv_cache, metadata.block_table[rows_t, :num_blocks])
        # keys: (num_decodes, max_len, num_kv_heads, head_size)
        num_decodes, max_len, num_kv_heads, head_size = keys.shape
        q = query[token_idx]  # (num_decodes, num_heads, head_size)
        group = q.shape[1] // num_kv_heads
        q = q.view(num_decodes, num_kv_heads, group, head_size)
        scores = torch.einsum("nhgd,nshd->nhgs", q, keys.to(q.dtype)) * scale
        positions = torch.arange(max_len)
        pad = positions[None, :] >= torch.from_numpy(seq_lens_np)[:, None]  # (n, max_len)
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.einsum("nhgs,nshd->nhgd", probs, values.to(q.dtype))
        output[token_idx] = out.reshape(num_decodes, -1, head_size)

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: KVCacheView,
        metadata: AttentionMetadata,
        row: int,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        """Many query tokens of one request, after `seq_len - query_len` cached tokens."""
        start, end = metadata.query_start_loc_np[row], metadata.query_start_loc_np[row + 1]
        seq_len = int(metadata.seq_lens_np[row])
        query_len = int(end - start)
        block_size = kv_cache[0].shape[1]
        num_blocks = -(-seq_len // block_size)
        keys, values = gather_kv(kv_cache, metadata.block_table[row : row + 1, :num_blocks])
        keys, values = keys[0, :seq_len], values[0, :seq_len]  # (seq_len, H_kv, D)
        q = query[start:end].transpose(0, 1)  # (num_heads, query_len, head_size)
        k = keys.transpose(0, 1).to(q.dtype)  # (num_kv_heads, seq_len, head_size)
        v = values.transpose(0, 1).to(q.dtype)
        mask = None
        if metadata.causal:
            # Query j sits at position (seq_len - query_len + j) and sees keys up to it.
            context_len = seq_len - query_len
            q_pos = torch.arange(query_len)[:, None] + context_len
            mask = torch.arange(seq_len)[None, :] <= q_pos  # (query_len, seq_len)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[0] != k.shape[0]
        )
        output[start:end] = out.transpose(0, 1)
