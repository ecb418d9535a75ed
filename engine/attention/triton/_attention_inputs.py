"""Input checks of `unified_attention`, all made before launch: shapes, dtypes, layouts."""

from __future__ import annotations

import torch
from kvferry.engine.attention.triton._runtime import check_dtype, check_index_dtype

# Head dims are padded to a power of two held in registers; 256 is the largest the tile
# budget allows (see unified_attention._gpu_tiles).
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
    _check_layouts(query, key_cache, value_cache, out, index_tensors)


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
    if head_size != key_cache.shape[3] or not 0 < head_size <= MAX_HEAD_SIZE:
        raise ValueError(
            f"head_size {head_size} (cache: {key_cache.shape[3]}) is not supported: query and "
            f"cache must agree and be at most {MAX_HEAD_SIZE}"
        )
    if num_heads % key_cache.shape[2]:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads; got {shapes}")


def _check_layouts(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor | None,
    index_tensors: dict[str, torch.Tensor],
) -> None:
    check_dtype("query", query)
    named = {"query": query, "key_cache": key_cache, "value_cache": value_cache}
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
