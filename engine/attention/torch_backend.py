"""The torch attention backend: the CPU path and the reference for the Triton kernels.

A step's batch mixes decodes (one query token) and prefills (many, possibly on top of a
cached prefix). Decodes run together, grouped by length, as padded batched attention over
keys gathered through the block table; each prefill runs as one causal
`scaled_dot_product_attention` call whose diagonal is shifted by its cached prefix.
Encoder self-attention runs one non-causal call per request over the step's own keys;
cross-attention reads the cross blocks like a prefix (decoder queries of one token take
the decode path, longer ones one non-causal call each).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from kvferry.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionType,
    KVCacheView,
)
from kvferry.engine.attention.cpu_kernels import paged_decode_kernel
from torch.nn.attention.bias import causal_lower_right

# Decodes are grouped by length so each group pads only to its own longest sequence;
# groups of fewer rows than this are not worth another call.
MIN_ROWS_PER_BUCKET = 8
MAX_BUCKETS = 8


def _block_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Views a layer's strided (num_blocks, *block) cache as contiguous rows of one block.

    Returns `(rows, scale, offset)` where block `b` of `cache` is `rows[b * scale + offset]`.
    `rows` spans the whole underlying storage: `index_select` over contiguous rows is a
    plain copy per row, several times faster on CPU than over the strided layer view.
    """
    row = cache[0].numel()
    stride, start = cache.stride(0), cache.storage_offset()
    if stride % row or start % row or not cache[0].is_contiguous():
        raise ValueError(
            f"KV cache view with stride {stride}, offset {start} is not laid out in whole "
            f"blocks of {row} elements"
        )
    num_rows = cache.untyped_storage().nbytes() // (row * cache.element_size())
    rows = cache.as_strided((num_rows, row), (row, 1), 0)
    return rows, stride // row, start // row


def write_kv_to_cache(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    kv_cache: KVCacheView,
    slot_mapping: torch.Tensor,  # (num_tokens,) int64
) -> None:
    """Stores each token's key and value at its slot (`block * block_size + offset`);
    a negative slot (a padding row) writes nothing outside the null block."""
    key_cache, value_cache = kv_cache
    block_size = key_cache.shape[1]
    # A negative slot marks a padding row: it goes to the null block (block 0, never read),
    # so no real block is touched and no host sync is needed to drop it.
    slot_mapping = slot_mapping.clamp(min=0)
    # The per-layer views are strided (layers sit between blocks), so slots cannot be
    # flattened into one axis; address them as (block, offset) pairs instead.
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


def gather_kv(
    kv_cache: KVCacheView,
    block_ids: torch.Tensor,  # (num_seqs, num_blocks) int32
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns keys and values of `block_ids`, each (num_seqs, num_blocks * block_size, H, D).

    `out`, when given, is a pair of flat buffers of at least that many elements to copy
    into (reusing memory avoids page faults on every layer's fresh allocation).
    """
    key_cache, value_cache = kv_cache
    num_seqs, num_blocks = block_ids.shape
    flat = block_ids.reshape(-1).long()
    shape = (num_seqs, num_blocks * key_cache.shape[1], *key_cache.shape[2:])
    gathered = []
    for cache, buffer in zip(kv_cache, out or (None, None)):
        rows, scale, offset = _block_rows(cache)
        index = flat * scale + offset
        if buffer is None:
            gathered.append(rows.index_select(0, index))
        else:
            target = buffer[: index.numel() * rows.shape[1]].view(index.numel(), rows.shape[1])
            gathered.append(torch.index_select(rows, 0, index, out=target))
    keys, values = gathered
    return keys.view(shape), values.view(shape)


def _length_buckets(rows: np.ndarray, seq_lens: np.ndarray) -> list[np.ndarray]:
    """Splits decode rows into up to MAX_BUCKETS groups of similar sequence length."""
    if rows.size == 0:
        return []
    num_buckets = min(MAX_BUCKETS, rows.size // MIN_ROWS_PER_BUCKET)
    if num_buckets <= 1:
        return [rows]
    by_length = rows[np.argsort(seq_lens[rows], kind="stable")]
    return np.array_split(by_length, num_buckets)


class _Workspace:
    """Grow-only flat buffers for gathered keys and values, reused across layers and steps."""

    def __init__(self) -> None:
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, numel: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        buffers = self._buffers
        if buffers is None or buffers[0].numel() < numel or buffers[0].dtype != like.dtype:
            size = max(numel, 0 if buffers is None else buffers[0].numel())
            buffers = (like.new_empty(size), like.new_empty(size))
            self._buffers = buffers
        return buffers


class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain torch ops; exact enough to compare with HF in float32."""

    name = "torch"

    def __init__(self, use_native_kernels: bool = True) -> None:
        self._workspace = _Workspace()
        # The native float32 CPU decode kernel (None: the plain torch path everywhere).
        self._decode_kernel = paged_decode_kernel() if use_native_kernels else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: KVCacheView | None,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if metadata.attn_type is AttentionType.ENCODER:
            assert key is not None and value is not None
            for row in range(metadata.num_reqs):
                self._attend_own_keys(query, key, value, metadata, row, scale, output)
            return output
        assert kv_cache is not None
        if metadata.attn_type is AttentionType.DECODER:
            assert key is not None and value is not None
            write_kv_to_cache(key[:num_tokens], value[:num_tokens], kv_cache,
                              metadata.slot_mapping)
        query_lens = metadata.query_lens_np
        # One query token over all of its request's keys: a decode, or a cross-attention
        # query (non-causal, but a single query sees every key either way).
        single = metadata.is_causal or metadata.attn_type is AttentionType.CROSS
        is_decode = query_lens == 1 if single else np.zeros_like(query_lens, dtype=bool)
        decode_rows = np.flatnonzero(is_decode)
        if decode_rows.size and self._native_decode(query, kv_cache):
            self._decode_native(query, kv_cache, metadata, decode_rows, scale, output)
        else:
            for rows in _length_buckets(decode_rows, metadata.seq_lens_np):
                self._decode(query, kv_cache, metadata, rows, scale, output)
        for row in np.flatnonzero(~is_decode).tolist():
            self._prefill(query, key, value, kv_cache, metadata, row, scale, output)
        return output

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCacheView,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv_to_cache(key, value, kv_cache, slot_mapping)

    @staticmethod
    def _attend_own_keys(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
        row: int,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        """Encoder self-attention of one request: every query sees every key of its request."""
        start, end = metadata.query_start_loc_np[row], metadata.query_start_loc_np[row + 1]
        q = query[start:end].transpose(0, 1)  # (num_heads, n, head_size)
        group = q.shape[0] // key.shape[1]
        k = key[start:end].transpose(0, 1).to(q.dtype).repeat_interleave(group, dim=0)
        v = value[start:end].transpose(0, 1).to(q.dtype).repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale)
        output[start:end] = out[0].transpose(0, 1)

    def _native_decode(self, query: torch.Tensor, kv_cache: KVCacheView) -> bool:
        return (
            self._decode_kernel is not None
            and query.device.type == "cpu"
            and query.dtype == kv_cache[0].dtype == torch.float32
        )

    def _decode_native(
        self,
        query: torch.Tensor,
        kv_cache: KVCacheView,
        metadata: AttentionMetadata,
        rows: np.ndarray,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        """All decodes in one call of the native kernel, reading the cache in place."""
        assert self._decode_kernel is not None
        seq_lens = np.ascontiguousarray(metadata.seq_lens_np[rows], dtype=np.int32)
        block_table = metadata.block_table
        if block_table.stride(-1) != 1:
            block_table = block_table.contiguous()
        self._decode_kernel(
            query.contiguous(),
            kv_cache[0],
            kv_cache[1],
            block_table,
            torch.from_numpy(rows.astype(np.int64, copy=False)),
            torch.from_numpy(metadata.query_start_loc_np[rows].astype(np.int64)),
            torch.from_numpy(seq_lens),
            int(seq_lens.max()),
            scale,
            output,
        )

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
        key_cache = kv_cache[0]
        block_size, num_kv_heads, head_size = key_cache.shape[1:]
        seq_lens_np = metadata.seq_lens_np[rows]
        num_blocks = int(-(-seq_lens_np.max() // block_size))
        block_ids = metadata.block_table[torch.from_numpy(rows), :num_blocks]
        workspace = self._workspace.get(block_ids.numel() * key_cache[0].numel(), key_cache)
        keys, values = gather_kv(kv_cache, block_ids, workspace)
        # keys: (num_decodes, max_len, num_kv_heads, head_size)
        num_decodes, max_len = keys.shape[:2]
        token_idx = torch.from_numpy(metadata.query_start_loc_np[rows]).long()
        # Grouped-query attention without repeating keys: the query heads that share a kv
        # head become that head's "query positions".
        q = query[token_idx].view(num_decodes, num_kv_heads, -1, head_size)
        # The mask is built where the queries live: a host-built mask would fail on a GPU.
        seq_lens = torch.from_numpy(seq_lens_np).to(query.device, non_blocking=True)
        valid = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]
        out = F.scaled_dot_product_attention(
            q,
            keys.transpose(1, 2).to(q.dtype),  # (n, num_kv_heads, max_len, head_size)
            values.transpose(1, 2).to(q.dtype),
            attn_mask=valid[:, None, None, :],
            scale=scale,
        )
        output[token_idx] = out.reshape(num_decodes, -1, head_size)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
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
        if seq_len == query_len and key is not None and value is not None:
            # Nothing cached before this chunk: its own keys are the whole sequence.
            keys, values = key[start:end], value[start:end]  # (seq_len, H_kv, D)
        else:
            block_size = kv_cache[0].shape[1]
            num_blocks = -(-seq_len // block_size)
            keys, values = gather_kv(kv_cache, metadata.block_table[row : row + 1, :num_blocks])
            keys, values = keys[0, :seq_len], values[0, :seq_len]
        q = query[start:end].transpose(0, 1)  # (num_heads, query_len, head_size)
        group = q.shape[0] // keys.shape[1]
        # Repeating kv heads beats SDPA's own GQA path on CPU and keeps the fused kernel.
        k = keys.transpose(0, 1).to(q.dtype).repeat_interleave(group, dim=0)
        v = values.transpose(0, 1).to(q.dtype).repeat_interleave(group, dim=0)
        if not metadata.is_causal:
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale)
        elif seq_len == query_len:
            out = F.scaled_dot_product_attention(
                q[None], k[None], v[None], is_causal=True, scale=scale
            )
        else:
            # Query j sits at position (seq_len - query_len + j): a causal mask aligned to
            # the bottom-right corner of the (query_len, seq_len) score matrix.
            out = F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=causal_lower_right(query_len, seq_len),
                scale=scale,
            )
        output[start:end] = out[0].transpose(0, 1)
