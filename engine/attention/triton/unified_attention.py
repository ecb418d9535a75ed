"""Paged attention for a whole step's flat batch in one launch: prefill, chunked prefill
over a cached prefix, and decode, causal or not.

Request `i` owns query rows `query_start_loc[i]:query_start_loc[i + 1]` and attends over the
first `seq_lens[i]` keys addressed by row `i` of `block_table` (key `k` lives at slot
`(block_table[i, k // block_size], k % block_size)`). Causal: query `j` of a request sits at
position `seq_lens[i] - query_len + j` and sees the keys up to it. Non-causal (encoder
self-attention, cross-attention): every query sees all `seq_lens[i]` keys, however many
queries there are; the block table is then the one of those keys.

Encoder self-attention (`encoder_attention`) runs the same kernel in its KV_FROM_BATCH
mode: request `i`'s keys are then the step's own key rows `query_start_loc[i]:
query_start_loc[i + 1]`, read in place from the (num_tokens, num_kv_heads, head_size)
key and value tensors with no block table and nothing written to a cache.

Work split: one program takes BLOCK_Q consecutive queries of one request and one kv head,
together with all query heads that share that kv head (BLOCK_M = BLOCK_Q * GROUP rows), so
each key tile is loaded once for the whole group. A program's tiles up to the first key some
row of it may not see (the causal edge, or a sequence's partial last tile) run without any
mask; only the tiles from there on mask keys and scores. With split-KV (flash-decoding) a third
grid axis cuts each request's keys into `num_splits` ranges; partial results (unnormalized
output, running max, running sum) go to a scratch buffer that `split_kv.reduce_kv_splits`
combines. That pays off when few requests with long contexts would leave most of the GPU
idle.
"""

from __future__ import annotations

import torch
from kvferry.engine.attention.triton._attention_inputs import check_attention_inputs
from kvferry.engine.attention.triton._attention_launch import (
    AttentionTuning,
    TileConfig,
    attention_tuning,
    device_capability,
    grid_size,
    launch_config,
)
from kvferry.engine.attention.triton._runtime import (
    check_device,
    is_interpreted,
    require_triton,
    tl,
    triton,
)
from kvferry.engine.attention.triton.split_kv import (
    allocate_partials,
    choose_num_kv_splits,
    reduce_kv_splits,
)

# The kernel takes exponentials base 2 (exp2 is the hardware's): scores are scaled by
# scale * log2(e) so that 2^(score) equals e^(scale * q.k).
LOG2_E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    # Request i owns grid blocks from query_start_loc[i] // BLOCK_Q + i on (see `grid_size`):
    # binary search for the last request whose first block is <= q_block.
    # Annotated, so both bounds are int32 tensors even when num_seqs == 1 arrives as a
    # compile-time constant.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    # DOT_IN_FP32: Triton's interpreter multiplies bfloat16 operands as their raw 16-bit
    # patterns, so there the products are formed in float32 (exact for bfloat16 inputs).
    if DOT_IN_FP32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=DOT_PRECISION)
    return c


@triton.jit
def _attend_tiles(
    q, acc, m_i, l_i, key_cache_ptr, value_cache_ptr, block_table_row_ptr,
    tile_lo, tile_hi, kv_end, query_pos, kv_head, head_size, block_size, qk_scale,
    stride_bt_block, stride_kc_block, stride_kc_offset, stride_kc_head,
    stride_vc_block, stride_vc_offset, stride_vc_head,
    MASKED: tl.constexpr, KV_FROM_BATCH: tl.constexpr, BLOCK_D: tl.constexpr,
    PAD_D: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    # q: (BLOCK_M, BLOCK_D); acc: (BLOCK_M, BLOCK_D) fp32; m_i, l_i: (BLOCK_M,) fp32, the
    # running max (log2 units) and sum of the online softmax.
    # MASKED False: the caller guarantees every key of these tiles exists and is visible to
    # every row, so neither the loads nor the scores need a mask (PAD_D: head dims padded
    # past head_size still do).
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_size
    for tile in range(tile_lo, tile_hi):
        keys = tile * TILE_N + tl.arange(0, TILE_N)  # (TILE_N,) key positions
        key_valid = keys < kv_end  # never past seq_len: later table entries are the null block
        if KV_FROM_BATCH:
            # The "cache" pointers start at the request's first key row: key k is row k.
            k_rows = keys.to(tl.int64) * stride_kc_block + kv_head * stride_kc_head
            v_rows = keys.to(tl.int64) * stride_vc_block + kv_head * stride_vc_head
        else:
            if MASKED:
                block = tl.load(block_table_row_ptr + (keys // block_size) * stride_bt_block,
                                mask=key_valid, other=0).to(tl.int64)
            else:
                block = tl.load(block_table_row_ptr
                                + (keys // block_size) * stride_bt_block).to(tl.int64)
            offset = keys % block_size
            k_rows = (block * stride_kc_block + offset * stride_kc_offset
                      + kv_head * stride_kc_head)
            v_rows = (block * stride_vc_block + offset * stride_vc_offset
                      + kv_head * stride_vc_head)
        k_ptrs = key_cache_ptr + k_rows[None, :] + dims[:, None]  # (BLOCK_D, TILE_N)
        v_ptrs = value_cache_ptr + v_rows[:, None] + dims[None, :]  # (TILE_N, BLOCK_D)
        if MASKED:
            kt = tl.load(k_ptrs, mask=key_valid[None, :] & dim_valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=key_valid[:, None] & dim_valid[None, :], other=0.0)
        elif PAD_D:
            kt = tl.load(k_ptrs, mask=dim_valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=dim_valid[None, :], other=0.0)
        else:
            kt = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = _dot(q, kt, DOT_PRECISION, DOT_IN_FP32) * qk_scale  # (BLOCK_M, TILE_N)
        if MASKED:
            visible = key_valid[None, :] & (keys[None, :] <= query_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if MASKED:
            # A row that has seen no key yet keeps max -inf; exp2(-inf - 0) = 0 avoids NaN.
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new  # every row saw a finite score in this tile
        p = tl.exp2(s - m_new_safe[:, None])  # (BLOCK_M, TILE_N)
        alpha = tl.exp2(m_i - m_new_safe)  # (BLOCK_M,) rescales what was summed so far
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_IN_FP32)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _key_tile_range(seq_len, kv_end, split, num_splits, IS_SPLIT: tl.constexpr,
                    TILE_N: tl.constexpr):
    # Key tiles [lo, hi) of this program: all up to kv_end, or this split's share of them.
    # Splits divide the whole sequence evenly, so under the causal mask a program may find
    # its share empty (lo >= hi), and a row may see none of its share's keys; either way
    # it writes max -inf and sum 0, which the reduction weighs as nothing.
    lo = split * 0
    hi = tl.cdiv(kv_end, TILE_N)
    if IS_SPLIT:
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len, TILE_N), num_splits)
        lo = split * tiles_per_split
        hi = tl.minimum(lo + tiles_per_split, hi)
    return lo, hi


@triton.jit
def _store_result(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, acc, m_i, l_i,
    token, head, split, row_valid, dim_valid, num_heads, num_splits,
    stride_o_token, stride_o_head, IS_SPLIT: tl.constexpr, BLOCK_D: tl.constexpr,
):
    dims = tl.arange(0, BLOCK_D)
    if IS_SPLIT:
        # Scratch rows are (token, head, split), contiguous; BLOCK_D floats per row.
        part = (token * num_heads + head) * num_splits + split  # (BLOCK_M,)
        tl.store(partial_out_ptr + part[:, None] * BLOCK_D + dims[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(partial_max_ptr + part, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + part, l_i, mask=row_valid)
    else:
        # A masked row has l = 0; dividing by 1 keeps it finite (it is not stored).
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_o_token + head[:, None] * stride_o_head
                 + dims[None, :], out, mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def _unified_attention_kernel(
    # pointers
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    query_ptr, key_cache_ptr, value_cache_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    # sizes
    qk_scale, num_seqs, num_heads, num_queries_per_kv, head_size, block_size, num_splits,
    # strides
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_kc_block, stride_kc_offset, stride_kc_head,
    stride_vc_block, stride_vc_offset, stride_vc_head,
    stride_bt_seq, stride_bt_block,
    # constexpr flags
    CAUSAL: tl.constexpr, IS_SPLIT: tl.constexpr, KV_FROM_BATCH: tl.constexpr,
    BLOCK_Q: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
    TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    # KV_FROM_BATCH: the key/value pointers are the step's (num_tokens, num_kv_heads,
    # head_size) tensors, seen as a cache of one-slot blocks; request i's keys are its own
    # query rows, so seq_lens and the block table are not read.
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP
    q_block, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    query_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start
    # This program's first query within its request.
    q_offset = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_offset >= query_len:  # a spare block of the grid (see `grid_size`)
        return
    if KV_FROM_BATCH:
        seq_len = query_len
        key_base_ptr = key_cache_ptr + q_start * stride_kc_block
        value_base_ptr = value_cache_ptr + q_start * stride_vc_block
    else:
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
        key_base_ptr = key_cache_ptr
        value_base_ptr = value_cache_ptr
    # Row r holds query q_offset + r // GROUP of query head kv_head * num_queries_per_kv
    # + r % GROUP; rows of padded group slots or past the request's end are masked.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_offset + rows // GROUP  # (BLOCK_M,)
    head = kv_head * num_queries_per_kv + rows % GROUP  # (BLOCK_M,)
    row_valid = (q_idx < query_len) & (rows % GROUP < num_queries_per_kv)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_size
    token = q_start + q_idx  # (BLOCK_M,)
    q = tl.load(query_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head
                + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if CAUSAL:
        query_pos = seq_len - query_len + q_idx  # (BLOCK_M,) absolute positions
        kv_end = tl.minimum(seq_len, seq_len - query_len + q_offset + BLOCK_Q)
    else:
        query_pos = tl.zeros([BLOCK_M], tl.int64) + seq_len - 1  # sees every key
        kv_end = seq_len
    tile_lo, tile_hi = _key_tile_range(seq_len, kv_end, split, num_splits, IS_SPLIT, TILE_N)
    # Tiles before `full_end` hold only keys every row of this program sees (causal: up to
    # the first row's position); only the tiles from there on need the masks.
    if CAUSAL:
        full_end = (seq_len - query_len + q_offset + 1) // TILE_N
    else:
        full_end = seq_len // TILE_N
    mid = tl.maximum(tl.minimum(full_end, tile_hi), tile_lo)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    table_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
    acc, m_i, l_i = _attend_tiles(
        q, acc, m_i, l_i, key_base_ptr, value_base_ptr, table_row_ptr, tile_lo, mid, kv_end,
        query_pos, kv_head, head_size, block_size, qk_scale,
        stride_bt_block, stride_kc_block, stride_kc_offset, stride_kc_head,
        stride_vc_block, stride_vc_offset, stride_vc_head,
        False, KV_FROM_BATCH, BLOCK_D, PAD_D, TILE_N, DOT_PRECISION, DOT_IN_FP32,
    )
    acc, m_i, l_i = _attend_tiles(
        q, acc, m_i, l_i, key_base_ptr, value_base_ptr, table_row_ptr, mid, tile_hi, kv_end,
        query_pos, kv_head, head_size, block_size, qk_scale,
        stride_bt_block, stride_kc_block, stride_kc_offset, stride_kc_head,
        stride_vc_block, stride_vc_offset, stride_vc_head,
        True, KV_FROM_BATCH, BLOCK_D, PAD_D, TILE_N, DOT_PRECISION, DOT_IN_FP32,
    )
    _store_result(
        out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, acc, m_i, l_i,
        token, head, split, row_valid, dim_valid, num_heads, num_splits,
        stride_o_token, stride_o_head, IS_SPLIT, BLOCK_D,
    )


def unified_attention(
    query: torch.Tensor,  # (num_tokens, num_heads, head_size)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size), strided
    value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size), strided
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32: keys of each request
    block_table: torch.Tensor,  # (num_seqs, max_num_blocks) int32
    scale: float,
    *,
    causal: bool = True,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,  # (num_tokens, num_heads, head_size)
) -> torch.Tensor:  # (num_tokens, num_heads, head_size)
    """Attention of every query of the flat batch over its request's paged keys.

    `query` holds exactly the batch's tokens (`query_start_loc[-1] == num_tokens`); query
    head `h` reads kv head `h // (num_heads // num_kv_heads)`. `max_query_len` and
    `max_seq_len` only plan the launch; pass them (the host knows them) to avoid a device
    sync. `num_kv_splits`: None picks split-KV by `choose_num_kv_splits`, 1 never splits,
    n > 1 splits every request's keys into n ranges. Raises ValueError before launch on
    unsupported shapes, dtypes (query and caches must share float32/float16/bfloat16),
    head sizes over 256 or a cache whose last dimension is not contiguous.
    """
    require_triton()
    check_attention_inputs(
        query, key_cache, value_cache, query_start_loc, seq_lens, block_table, out
    )
    out = prepare_output(
        query, out, num_kv_splits, key_cache=key_cache, value_cache=value_cache,
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
    )
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    tuning = launch_tuning(query)
    if num_kv_splits is None:
        max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
        num_kv_splits = choose_num_kv_splits(
            seq_lens.shape[0], key_cache.shape[2], max_query_len, max_seq_len,
            **split_policy(tuning),
        )
    launch_kernel(
        query, (key_cache, value_cache), query_start_loc, seq_lens,
        block_table, scale, causal, max_query_len, num_kv_splits, out, tuning=tuning,
    )
    return out


def launch_tuning(query: torch.Tensor) -> AttentionTuning | None:
    """The tuning table a launch on `query`'s device takes, looked up once per call (None
    under the interpreter, where only the default split policy applies)."""
    if is_interpreted(_unified_attention_kernel) or query.device.type != "cuda":
        return None
    return attention_tuning(device_capability(query.device))


def split_policy(tuning: AttentionTuning | None) -> dict[str, int]:
    """`choose_num_kv_splits`' keyword arguments: the table's split policy, or the
    defaults (no table)."""
    if tuning is None:
        return {}
    return {"target_programs": tuning.target_programs,
            "min_keys_per_split": tuning.min_keys_per_split}


def prepare_output(
    query: torch.Tensor,
    out: torch.Tensor | None,
    num_kv_splits: int | None,
    **tensors: torch.Tensor,
) -> torch.Tensor:
    """The last checks before a launch (`num_kv_splits`, one device the kernel runs on for
    `query`, `out` and `tensors`); returns `out`, or a new output like `query`."""
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be None or >= 1, got {num_kv_splits}")
    out = torch.empty_like(query) if out is None else out
    check_device(_unified_attention_kernel, query=query, **tensors, out=out)
    return out


def launch_kernel(
    query: torch.Tensor,  # (num_tokens, num_heads, head_size)
    kv: tuple[torch.Tensor, torch.Tensor],  # each (num_blocks, block_size, num_kv_heads, D)
    query_start_loc: torch.Tensor,  # (num_seqs + 1,)
    seq_lens: torch.Tensor | None,  # (num_seqs,); None: keys from the batch
    block_table: torch.Tensor | None,  # (num_seqs, max_num_blocks); None: keys from the batch
    scale: float,
    causal: bool,
    max_query_len: int,
    num_kv_splits: int,
    out: torch.Tensor,  # (num_tokens, num_heads, head_size), written
    config: TileConfig | None = None,
    tuning: AttentionTuning | None = None,
) -> None:
    """Launches the kernel (and the split-KV reduction) over inputs already checked;
    `config` overrides the tuning table's tiles (on a GPU); `tuning` is the table, when the
    caller has looked it up (`launch_tuning`).

    `kv` is the key/value cache pair, or with `block_table` None the step's own keys and
    values as one-slot blocks (`encoder_attention`'s KV_FROM_BATCH mode).
    """
    key_cache, value_cache = kv
    num_tokens, num_heads, head_size = query.shape
    num_seqs, num_kv_heads = query_start_loc.shape[0] - 1, key_cache.shape[2]
    kv_from_batch = block_table is None
    if kv_from_batch:
        # Never read: any int tensor fills the pointer arguments, strides 0.
        seq_lens, block_table, table_strides = query_start_loc, query_start_loc, (0, 0)
    else:
        table_strides = block_table.stride()
    tiles = launch_config(
        query, num_kv_heads, max_query_len, is_interpreted(_unified_attention_kernel), config,
        tuning,
    )
    is_split = num_kv_splits > 1
    partials = (
        allocate_partials(num_tokens, num_heads, num_kv_splits, tiles["BLOCK_D"], query.device)
        if is_split else (out, out, out)  # unused: the kernel writes `out` directly
    )
    grid = (grid_size(num_tokens, num_seqs, tiles["BLOCK_Q"]), num_kv_heads, num_kv_splits)
    _unified_attention_kernel[grid](
        out, *partials, query, key_cache, value_cache, query_start_loc, seq_lens, block_table,
        scale * LOG2_E, num_seqs, num_heads, num_heads // num_kv_heads, head_size,
        key_cache.shape[1], num_kv_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        *table_strides,
        CAUSAL=causal, IS_SPLIT=is_split, KV_FROM_BATCH=kv_from_batch, **tiles,
    )
    if is_split:
        reduce_kv_splits(*partials, out)


def unified_attention_reference(
    query: torch.Tensor,  # (num_tokens, num_heads, head_size)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    query_start_loc: torch.Tensor,  # (num_seqs + 1,)
    seq_lens: torch.Tensor,  # (num_seqs,)
    block_table: torch.Tensor,  # (num_seqs, max_num_blocks)
    scale: float,
    *,
    causal: bool = True,
) -> torch.Tensor:  # (num_tokens, num_heads, head_size)
    """Plain-torch `unified_attention`: per request, gather its keys and attend densely.

    Computes in float32 (float64 for float64 inputs) and returns the query's dtype.
    """
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = torch.empty_like(query)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        positions = torch.arange(seq_len, device=query.device)  # (seq_len,)
        blocks = block_table[i, positions // block_size].long()
        offsets = positions % block_size
        k = key_cache[blocks, offsets].to(compute).repeat_interleave(group, dim=1)
        v = value_cache[blocks, offsets].to(compute).repeat_interleave(group, dim=1)
        q = query[start:end].to(compute)  # (query_len, num_heads, head_size)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # (num_heads, query_len, seq_len)
        if causal:
            query_pos = seq_len - (end - start) + torch.arange(end - start, device=query.device)
            visible = positions[None, :] <= query_pos[:, None]  # (query_len, seq_len)
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
