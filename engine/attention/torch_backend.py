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
    flat = block_ids.reshape(-1).long()
    # index_select copies whole blocks; advanced indexing on these strided views is many
    # times slower on CPU.
    shape = (num_seqs, num_blocks * key_cache.shape[1], *key_cache.shape[2:])
    keys = key_cache.index_select(0, flat).view(shape)
    values = value_cache.index_select(0, flat).view(shape)
    return keys, values


# Decodes are grouped by length so each group pads only to its own longest sequence;
# groups of fewer rows than this are not worth another call.
MIN_ROWS_PER_BUCKET = 16
MAX_BUCKETS = 4


def _length_buckets(rows: np.ndarray, seq_lens: np.ndarray) -> list[np.ndarray]:
    """Splits decode rows into up to MAX_BUCKETS groups of similar sequence length."""
    if rows.size == 0:
        return []
    num_buckets = min(MAX_BUCKETS, rows.size // MIN_ROWS_PER_BUCKET)
    if num_buckets <= 1:
        return [rows]
    by_length = rows[np.argsort(seq_lens[rows], kind="stable")]
    return np.array_split(by_length, num_buckets)


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
        for rows in _length_buckets(np.flatnonzero(is_decode), metadata.seq_lens_np):
            self._decode(query, kv_cache, metadata, rows, scale, output)
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
        num_decodes, max_len = keys.shape[:2]
        q = query[token_idx].unsqueeze(2)  # (num_decodes, num_heads, 1, head_size)
        positions = torch.arange(max_len)
        valid = positions[None, :] < torch.from_numpy(seq_lens_np)[:, None]  # (n, max_len)
        out = F.scaled_dot_product_attention(
            q,
            keys.transpose(1, 2).to(q.dtype),  # (n, num_kv_heads, max_len, head_size)
            values.transpose(1, 2).to(q.dtype),
            attn_mask=valid[:, None, None, :],
            scale=scale,
            enable_gqa=q.shape[1] != keys.shape[2],
        )
        output[token_idx] = out.squeeze(2)

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
