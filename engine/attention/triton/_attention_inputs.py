"""Input checks of `unified_attention` and `encoder_attention`, all made before launch:
shapes, dtypes, layouts."""

from __future__ import annotations

import torch
from kvferry.engine.attention.triton._runtime import check_dtype, check_index_dtype

# Head dims are padded to a power of two held in registers; 256 is the largest the tile
# budget allows (see _attention_launch.gpu_tiles).
MAX_HEAD_SIZE = 256


def check_attention_inputs(
    query: torch.Tensor,  # (num_tokens, num_heads, head_size)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    query_start_loc: torch.Tensor,  # (num_seqs + 1,)
    seq_lens: torch.Tensor,  # (num_seqs,)
    block_table: torch.Tensor,  # (>= num_seqs, max_num_blocks)
    out: torch.Tensor | None,  # (num_tokens, num_heads, head_size)
) -> None:
    """Raises ValueError, naming the argument, on any input the kernel does not support."""
    _check_shapes(query, key_cache, value_cache, query_start_loc, seq_lens, block_table)
    index_tensors = {
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
        "block_table": block_table,
    }
    _check_layouts(
        {"query": query, "key_cache": key_cache, "value_cache": value_cache}, out, index_tensors
    )


def check_encoder_inputs(
    query: torch.Tensor,  # (num_tokens, num_heads, head_size)
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    query_start_loc: torch.Tensor,  # (num_seqs + 1,)
    out: torch.Tensor | None,  # (num_tokens, num_heads, head_size)
) -> None:
    """Raises ValueError, naming the argument, on any input `encoder_attention` does not
    support."""
    shapes = (
        f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}, "
        f"query_start_loc {tuple(query_start_loc.shape)}"
    )
    if (
        query.dim() != 3
        or key.dim() != 3
        or key.shape != value.shape
        or key.shape[0] != query.shape[0]
        or query_start_loc.dim() != 1
        or query_start_loc.shape[0] < 1
    ):
        raise ValueError(
            "expected query (num_tokens, num_heads, head_size), key and value (num_tokens, "
            f"num_kv_heads, head_size), query_start_loc (num_seqs + 1,); got {shapes}"
        )
    _check_heads(query.shape[1], query.shape[2], key.shape[1], key.shape[2], shapes)
    _check_layouts({"query": query, "key": key, "value": value}, out,
                   {"query_start_loc": query_start_loc})


def _check_shapes(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    shapes = ", ".join(
        f"{name} {tuple(t.shape)}"
        for name, t in (
            ("query", query),
            ("key_cache", key_cache),
            ("value_cache", value_cache),
            ("query_start_loc", query_start_loc),
            ("seq_lens", seq_lens),
            ("block_table", block_table),
        )
    )
    if (
        query.dim() != 3
        or key_cache.dim() != 4
        or key_cache.shape != value_cache.shape
        or seq_lens.dim() != 1
        or query_start_loc.shape != (seq_lens.shape[0] + 1,)
        or block_table.dim() != 2
        or block_table.shape[0] < seq_lens.shape[0]
    ):
        raise ValueError(
            "expected query (num_tokens, num_heads, head_size), caches (num_blocks, "
            "block_size, num_kv_heads, head_size), query_start_loc (num_seqs + 1,), "
            f"seq_lens (num_seqs,), block_table (>= num_seqs, max_num_blocks); got {shapes}"
        )
    num_heads, head_size = query.shape[1:]
    _check_heads(num_heads, head_size, key_cache.shape[2], key_cache.shape[3], shapes)


def _check_heads(
    num_heads: int, head_size: int, num_kv_heads: int, kv_head_size: int, shapes: str
) -> None:
    if head_size != kv_head_size or not 0 < head_size <= MAX_HEAD_SIZE:
        raise ValueError(
            f"head_size {head_size} (keys: {kv_head_size}) is not supported: query and "
            f"keys must agree and be at most {MAX_HEAD_SIZE}"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads; got {shapes}")


def _check_layouts(
    named: dict[str, torch.Tensor],  # the query first, then the keys and values
    out: torch.Tensor | None,
    index_tensors: dict[str, torch.Tensor],
) -> None:
    query = named["query"]
    check_dtype("query", query)
    named = dict(named)
    if out is not None:
        if out.shape != query.shape:
            raise ValueError(f"out is {tuple(out.shape)}, query is {tuple(query.shape)}")
        named["out"] = out
    for name, tensor in named.items():
        check_dtype(name, tensor, query.dtype)
        if tensor.stride(-1) != 1:
            raise ValueError(
                f"{name} has strides {tensor.stride()}: the kernel needs head_size to be its "
                "contiguous last dimension"
            )
    for name, tensor in index_tensors.items():
        check_index_dtype(name, tensor)
