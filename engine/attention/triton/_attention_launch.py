"""How a launch of the unified attention kernel is shaped: its tiles, warps and grid."""

from __future__ import annotations

import torch
from kvferry.engine.attention.triton._runtime import next_power_of_2

# Register budget per program of `gpu_tiles`, in bytes of query rows plus keys times
# head dims.
TILE_BUDGET_BYTES = 24576


def launch_config(
    query: torch.Tensor, num_kv_heads: int, max_query_len: int, interpreted: bool
) -> dict[str, int | str | bool | None]:
    """The kernel's constexprs and warps: BLOCK_Q queries by GROUP heads per program,
    TILE_N keys per step, BLOCK_D padded head dims, and how the dots run."""
    num_heads, head_size = query.shape[1:]
    group = next_power_of_2(num_heads // num_kv_heads)
    block_d = max(16, next_power_of_2(head_size))
    if interpreted:
        # The interpreter pays per operation, not per element: few, large tiles.
        rows, tile_n = (64 if max_query_len * group >= 32 else 16), 32
    else:
        rows, tile_n = gpu_tiles(group, block_d, max_query_len, query.element_size())
    return {
        "BLOCK_Q": max(1, rows // group),
        "GROUP": group,
        "BLOCK_D": block_d,
        "TILE_N": tile_n,
        # float32 attention stays float32 (no TF32) to match the torch path; half types
        # take the target's default.
        "DOT_PRECISION": "ieee" if query.dtype == torch.float32 else None,
        "DOT_IN_FP32": interpreted and query.dtype == torch.bfloat16,
        "num_warps": 8,
    }


def gpu_tiles(group: int, block_d: int, max_query_len: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_M, TILE_N) for a GPU: the largest that keep a program's query tile and its
    gathered key/value pointers in registers.

    Each key of a tile is gathered through the block table, so the K and V tiles need a
    pointer per element; past about TILE_BUDGET_BYTES of (query rows + keys) x head dims
    per program (8 warps), ptxas spills (its register reports for sm_90, Triton 3.9).
    """
    budget = TILE_BUDGET_BYTES // element_size
    # tl.dot needs 16 rows; a program of many queries amortizes each key tile (prefill).
    rows = max(64 if max_query_len * group >= 64 else 16, group)
    while rows > max(16, group) and block_d * (rows + 16) > budget:
        rows //= 2
    tile_n = 64
    while tile_n > 16 and block_d * (tile_n + rows) > budget:
        tile_n //= 2
    return rows, tile_n


def grid_size(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Programs along the query axis: every request gets its own blocks of BLOCK_Q queries.

    Request i's blocks start at `query_start_loc[i] // BLOCK_Q + i`. Worked example with
    BLOCK_Q 4 and query lengths [5, 1, 6] (starts 0, 5, 6): request 0 starts at 0 and needs
    2 blocks, request 1 starts at 5 // 4 + 1 = 2 and needs 1, request 2 starts at
    6 // 4 + 2 = 3 and needs 2; 12 // 4 + 3 = 6 blocks cover them, one of them spare (its
    program finds its request already covered and returns).
    """
    return num_tokens // block_q + num_seqs
