"""The torch backend against a naive reference: per request, dense causal attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvferry.engine.attention.backend import AttentionMetadata, AttentionType
from kvferry.engine.attention.torch_backend import TorchAttentionBackend, _length_buckets

NUM_LAYERS, BLOCK_SIZE, NUM_BLOCKS = 2, 4, 512


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """q (Lq, H, D) attends over k/v (Lk, Hkv, D); the queries are the last Lq positions."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        offset = k.shape[0] - q.shape[0]
        allowed = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + offset
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def _run_case(query_lens: list[int], context_lens: list[int], num_heads: int, num_kv_heads: int,
              causal: bool = True, seed: int = 0, native: bool = True) -> None:
    gen = torch.Generator().manual_seed(seed)
    head_size = 8
    cache = torch.zeros(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, num_kv_heads, head_size)
    kv_cache = (cache[:, 1, 0], cache[:, 1, 1])  # a strided view, as the engine uses
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(np.arange(1, NUM_BLOCKS)))
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    max_blocks = max(-(-s // BLOCK_SIZE) for s in seq_lens)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    full_keys, full_values, slots = [], [], []
    for row, (q_len, ctx, seq) in enumerate(zip(query_lens, context_lens, seq_lens)):
        blocks = [int(free.pop()) for _ in range(-(-seq // BLOCK_SIZE))]
        block_table[row, : len(blocks)] = torch.tensor(blocks)
        keys = torch.randn(seq, num_kv_heads, head_size, generator=gen)
        values = torch.randn(seq, num_kv_heads, head_size, generator=gen)
        for pos in range(ctx):  # the cached prefix, written by earlier steps
            kv_cache[0][blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = keys[pos]
            kv_cache[1][blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = values[pos]
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx, seq)]
        full_keys.append(keys)
        full_values.append(values)
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=gen)
    key = torch.cat([k[c:] for k, c in zip(full_keys, context_lens)])
    value = torch.cat([v[c:] for v, c in zip(full_values, context_lens)])
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_np = np.array(seq_lens, dtype=np.int32)
    metadata = AttentionMetadata(
        num_reqs=len(seq_lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq_np), block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_np=qsl,
        seq_lens_np=seq_np, causal=causal,
    )
    scale = head_size**-0.5
    backend = TorchAttentionBackend(use_native_kernels=native)
    assert (backend._decode_kernel is not None) == native
    output = backend.forward(query, key, value, kv_cache, metadata, scale)
    for row, (start, end) in enumerate(zip(qsl[:-1], qsl[1:])):
        expected = _reference(query[start:end], full_keys[row], full_values[row], scale, causal)
        torch.testing.assert_close(output[start:end], expected, atol=1e-5, rtol=1e-5)
    # Every new key landed in its slot of the layer's view, and nowhere else in the tensor.
    for row, ctx in enumerate(context_lens):
        blocks = block_table[row]
        for pos in range(ctx, seq_lens[row]):
            got = kv_cache[0][blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE]
            torch.testing.assert_close(got, full_keys[row][pos])
    assert cache[:, 0].abs().sum() == 0


# Decodes run in the native kernel where it builds (CI has a compiler) or in plain torch.
NATIVE = pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])


@NATIVE
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 1)])
def test_mixed_batch_of_decodes_prefills_and_chunked_prefills(
    num_heads, num_kv_heads, native
) -> None:
    # 20 decodes of varied lengths (several length groups), two fresh prefills, two chunks
    # on top of a cached prefix.
    rng = np.random.default_rng(1)
    decode_ctx = rng.integers(1, 60, size=20).tolist()
    query_lens = [1] * 20 + [7, 13, 5, 9]
    context_lens = decode_ctx + [0, 0, 13, 22]
    _run_case(query_lens, context_lens, num_heads, num_kv_heads, native=native)


@NATIVE
def test_decodes_only_with_long_and_single_token_contexts(native) -> None:
    # A decode whose whole sequence is its one new token, and contexts many blocks long.
    _run_case([1] * 5, [0, 1, 3, 150, 97], num_heads=8, num_kv_heads=2, native=native)


@NATIVE
def test_single_token_prompt_is_a_prefill_of_length_one(native) -> None:
    _run_case([1, 1, 3], [0, 5, 0], num_heads=4, num_kv_heads=2, native=native)


def test_non_causal_attention_sees_every_key() -> None:
    _run_case([6, 3, 1], [0, 0, 0], num_heads=4, num_kv_heads=2, causal=False)


def test_length_buckets_group_similar_lengths_and_cover_every_row() -> None:
    seq_lens = np.array([50, 3, 40, 7, 60, 5, 45, 2] * 4)
    rows = np.arange(seq_lens.size)
    buckets = _length_buckets(rows, seq_lens)
    assert len(buckets) == 4
    assert sorted(np.concatenate(buckets).tolist()) == rows.tolist()
    maxima = [seq_lens[b].max() for b in buckets]
    minima = [seq_lens[b].min() for b in buckets]
    assert all(hi <= lo for hi, lo in zip(maxima, minima[1:]))
    # Too few rows to be worth splitting: one group, in the given order.
    assert [b.tolist() for b in _length_buckets(rows[:5], seq_lens)] == [[0, 1, 2, 3, 4]]
    assert _length_buckets(rows[:0], seq_lens) == []


def test_a_padding_slot_writes_no_block_but_the_null_block() -> None:
    from kvferry.engine.attention.torch_backend import write_kv_to_cache

    torch.manual_seed(0)
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]
    cache = torch.randn(4, 2, 2, 4, 2, 8)
    before = cache.clone()
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv_to_cache(key, value, (cache[:, 1, 0], cache[:, 1, 1]),
                      torch.tensor([5, -1, 9]))
    # Slot 5 is block 1, offset 1; slot 9 is block 2, offset 1 (layer 1 of the cache).
    assert torch.equal(cache[1, 1, 0, 1], key[0]) and torch.equal(cache[2, 1, 1, 1], value[2])
    touched = torch.zeros_like(cache, dtype=torch.bool)
    touched[1, 1, :, 1] = True
    touched[2, 1, :, 1] = True
    touched[0] = True  # the padding row may land in the null block only
    assert torch.equal(cache[~touched], before[~touched])


def _cross_case(query_lens: list[int], encoder_lens: list[int], native: bool) -> None:
    """Cross-attention: queries of any length over a request's cached encoder keys, which
    the backend must neither causally mask nor overwrite."""
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_size = 4, 2, 8
    cache = torch.zeros(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, num_kv_heads, head_size)
    kv_cache = (cache[:, 0, 0], cache[:, 0, 1])
    max_blocks = max(-(-n // BLOCK_SIZE) for n in encoder_lens)
    block_table = torch.zeros(len(encoder_lens), max_blocks, dtype=torch.int32)
    keys, values, next_block = [], [], 1
    backend = TorchAttentionBackend(use_native_kernels=native)
    for row, n in enumerate(encoder_lens):
        blocks = list(range(next_block, next_block + -(-n // BLOCK_SIZE)))
        next_block += len(blocks)
        block_table[row, : len(blocks)] = torch.tensor(blocks)
        k = torch.randn(n, num_kv_heads, head_size, generator=gen)
        v = torch.randn(n, num_kv_heads, head_size, generator=gen)
        slots = torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                              for p in range(n)])
        backend.write_kv(k, v, kv_cache, slots)
        keys.append(k)
        values.append(v)
    before = cache.clone()
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=gen)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    enc = np.array(encoder_lens, dtype=np.int32)
    metadata = AttentionMetadata(
        num_reqs=len(enc), num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=int(enc.max()), query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(enc), block_table=block_table,
        slot_mapping=torch.empty(0, dtype=torch.int64), query_start_loc_np=qsl,
        seq_lens_np=enc, attn_type=AttentionType.CROSS,
    )
    output = backend.forward(query, None, None, kv_cache, metadata, head_size**-0.5)
    for row, (start, end) in enumerate(zip(qsl[:-1], qsl[1:])):
        expected = _reference(query[start:end], keys[row], values[row], head_size**-0.5, False)
        torch.testing.assert_close(output[start:end], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, before)


@NATIVE
def test_cross_attention_reads_encoder_keys_without_writing(native: bool) -> None:
    # Single-token decoder queries beside prompts shorter and longer than the encoder.
    _cross_case([1, 5, 1, 12, 9], [7, 9, 30, 4, 9], native)


def test_encoder_attention_is_non_causal_over_its_own_keys_only() -> None:
    gen = torch.Generator().manual_seed(4)
    lens = [5, 1, 11]
    num_heads, num_kv_heads, head_size = 4, 4, 8
    total = sum(lens)
    q = torch.randn(total, num_heads, head_size, generator=gen)
    k = torch.randn(total, num_kv_heads, head_size, generator=gen)
    v = torch.randn(total, num_kv_heads, head_size, generator=gen)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    seq = np.array(lens, dtype=np.int32)
    metadata = AttentionMetadata(
        num_reqs=3, num_actual_tokens=total, max_query_len=11, max_seq_len=11,
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq),
        block_table=torch.empty(3, 0, dtype=torch.int32),
        slot_mapping=torch.empty(0, dtype=torch.int64), query_start_loc_np=qsl,
        seq_lens_np=seq, attn_type=AttentionType.ENCODER,
    )
    output = TorchAttentionBackend().forward(q, k, v, None, metadata, head_size**-0.5)
    for start, end in zip(qsl[:-1], qsl[1:]):
        expected = _reference(q[start:end], k[start:end], v[start:end], head_size**-0.5, False)
        torch.testing.assert_close(output[start:end], expected, atol=1e-5, rtol=1e-5)
