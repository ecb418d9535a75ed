"""Unified paged attention against its torch reference, the torch backend and a float64
naive reference, over mixed batches: decodes beside fresh and chunked prefills, shared
prefix blocks, the null block, GQA/MQA, non-causal self- and cross-attention, split-KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvferry.engine.attention.triton.split_kv import choose_num_kv_splits
from kvferry.engine.attention.triton.unified_attention import (
    unified_attention,
    unified_attention_reference,
)

# Decodes over 13, 37 and 70 keys (70: several key tiles), a fresh prefill of 9, a chunk of 5
# over 16 cached keys, a fresh prefill of 14: lengths cross blocks (block size 4) and tiles.
MIXED = ([1, 9, 1, 5, 1, 14], [13, 9, 37, 21, 70, 14])
# Block size 16; every request after the first reuses the first's 2 cached blocks.
SHARED = ([1, 3, 1, 6], [40, 35, 60, 50])
ENCODER = ([7, 12, 3], [7, 12, 3])  # non-causal over the step's own keys
CROSS = ([3, 1, 6], [20, 33, 9])  # non-causal over cached keys of another length

HEADS = {  # (num_heads, num_kv_heads, head_size)
    "gqa1-d16": (4, 4, 16),
    "gqa3-d80": (6, 2, 80),
    "gqa4-d32": (8, 2, 32),
    "mqa8-d128": (8, 1, 128),
    "gqa8-d32": (16, 2, 32),
}


def _run_kernel(batch, scale: float, num_kv_splits: int) -> torch.Tensor:
    m = batch.metadata
    out = torch.full_like(batch.query, float("nan"))  # every element must be written
    key_cache, value_cache = batch.kv_cache
    result = unified_attention(
        batch.query,
        key_cache,
        value_cache,
        m.query_start_loc,
        m.seq_lens,
        m.block_table,
        scale,
        causal=m.causal,
        max_query_len=m.max_query_len,
        max_seq_len=m.max_seq_len,
        num_kv_splits=num_kv_splits,
        out=out,
    )
    assert result is out
    return out


def _check(batch, dtype, num_kv_splits, assert_close, references) -> None:
    scale = batch.query.shape[-1] ** -0.5
    out = _run_kernel(batch, scale, num_kv_splits)
    m = batch.metadata
    expected = unified_attention_reference(
        batch.query,
        *batch.kv_cache,
        m.query_start_loc,
        m.seq_lens,
        m.block_table,
        scale,
        causal=m.causal,
    )
    assert_close(out, expected, dtype, "against the torch reference")
    naive, torch_backend = references
    assert_close(out, naive(batch, scale), dtype, "against the float64 reference")
    assert_close(out, torch_backend(batch, scale), dtype, "against the torch backend")


@pytest.mark.parametrize("num_kv_splits", [1, 3], ids=["nosplit", "split3"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_causal_mixed_batch_float32(
    device, heads, num_kv_splits, paged_batch, assert_close, references
) -> None:
    batch = paged_batch(*MIXED, *heads, torch.float32, device, seed=sum(heads))
    # Table entries past each request's blocks are the null block, whose slots (like the
    # tails of last blocks) hold NaN: one read of them would poison the output.
    assert (batch.metadata.block_table == 0).any() and batch.cache[0].isnan().all()
    _check(batch, torch.float32, num_kv_splits, assert_close, references)


@pytest.mark.parametrize("num_kv_splits", [1, 2], ids=["nosplit", "split2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads", ["gqa3-d80", "mqa8-d128"])
def test_causal_mixed_batch_half(
    device, heads, dtype, num_kv_splits, paged_batch, assert_close, references
) -> None:
    batch = paged_batch(*MIXED, *HEADS[heads], dtype, device, seed=7)
    _check(batch, dtype, num_kv_splits, assert_close, references)


@pytest.mark.parametrize("num_kv_splits", [1, 4], ids=["nosplit", "split4"])
def test_shared_prefix_blocks(device, num_kv_splits, paged_batch, assert_close, references) -> None:
    batch = paged_batch(
        *SHARED, 6, 2, 32, torch.float32, device, block_size=16, num_shared_blocks=2, seed=3
    )
    table = batch.metadata.block_table
    assert (table[1:, :2] == table[0, :2]).all()  # the same physical blocks
    _check(batch, torch.float32, num_kv_splits, assert_close, references)


@pytest.mark.parametrize("num_kv_splits", [2, 3], ids=["split2", "split3"])
def test_split_kv_over_a_long_chunk(
    device, num_kv_splits, paged_batch, assert_close, references
) -> None:
    # 40 queries at positions 30..69 span three key tiles: in a later split the first rows
    # of a program see no key at all, and must contribute nothing (not NaN).
    batch = paged_batch([40, 1], [70, 50], 6, 2, 32, torch.float32, device, seed=13)
    _check(batch, torch.float32, num_kv_splits, assert_close, references)


def _random_lengths(rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """2 to 6 requests, each a decode, a fresh prefill or a chunk over a cached prefix."""
    query_lens, seq_lens = [], []
    for kind in rng.choice(["decode", "prefill", "chunk"], size=rng.integers(2, 7)):
        query_len = 1 if kind == "decode" else int(rng.integers(2, 20))
        context = 0 if kind == "prefill" else int(rng.integers(1, 60))
        query_lens.append(query_len)
        seq_lens.append(context + query_len)
    return query_lens, seq_lens


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(device, seed, paged_batch, assert_close, references) -> None:
    rng = np.random.default_rng(seed)
    heads = list(HEADS.values())[rng.integers(len(HEADS))]
    block_size = int(rng.choice([4, 8, 16]))
    batch = paged_batch(
        *_random_lengths(rng), *heads, torch.float32, device, block_size=block_size, seed=seed
    )
    _check(batch, torch.float32, int(rng.integers(1, 4)), assert_close, references)


NON_CAUSAL = [  # (lengths, num_heads, num_kv_heads, head_size, dtype)
    pytest.param(ENCODER, 4, 4, 16, torch.float32, id="encoder-fp32"),
    pytest.param(ENCODER, 6, 2, 96, torch.bfloat16, id="encoder-gqa3-d96-bf16"),
    pytest.param(CROSS, 8, 2, 32, torch.float32, id="cross-gqa4-fp32"),
    pytest.param(CROSS, 4, 1, 256, torch.float16, id="cross-mqa-d256-fp16"),
]


@pytest.mark.parametrize("num_kv_splits", [1, 2], ids=["nosplit", "split2"])
@pytest.mark.parametrize(("lengths", "num_heads", "num_kv_heads", "head_size", "dtype"), NON_CAUSAL)
def test_non_causal_sees_every_key(
    device,
    lengths,
    num_heads,
    num_kv_heads,
    head_size,
    dtype,
    num_kv_splits,
    paged_batch,
    assert_close,
    references,
) -> None:
    writes_keys = lengths is ENCODER  # cross-attention keys are all cached already
    batch = paged_batch(
        *lengths,
        num_heads,
        num_kv_heads,
        head_size,
        dtype,
        device,
        causal=False,
        writes_keys=writes_keys,
        seed=head_size,
    )
    _check(batch, dtype, num_kv_splits, assert_close, references)


# Lengths at the edges of the kernel's unmasked and masked key tiles (32 keys a tile under
# the interpreter): decodes over exactly one tile, one past it, one short of it, two tiles,
# three; a chunk of 38 over 62 cached keys (its first row is at position 62, one short of a
# tile's last key); a fresh prefill of 65 (programs at offsets 0, 16, 32, 48, 64).
EDGES = ([1, 1, 1, 1, 38, 65, 1], [32, 33, 31, 64, 100, 65, 96])


@pytest.mark.parametrize("num_kv_splits", [1, 2], ids=["nosplit", "split2"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_keys_at_the_edges_of_unmasked_tiles(
    device, causal, num_kv_splits, paged_batch, assert_close, references
) -> None:
    batch = paged_batch(*EDGES, 8, 2, 32, torch.float32, device, causal=causal, block_size=16,
                        seed=17)
    _check(batch, torch.float32, num_kv_splits, assert_close, references)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_keys_at_the_edges_of_unmasked_tiles_padded_head(
    device, dtype, paged_batch, assert_close, references
) -> None:
    # Head size 80 pads to 128 dims: unmasked tiles still mask the padded dims.
    batch = paged_batch(*EDGES, 6, 2, 80, dtype, device, block_size=16, seed=19)
    _check(batch, dtype, 1, assert_close, references)


def test_heuristic_splits_few_long_decodes(device, paged_batch, assert_close, references) -> None:
    lengths = ([1, 1], [1100, 700])
    assert choose_num_kv_splits(2, 1, 1, 1100) == 2
    batch = paged_batch(*lengths, 4, 1, 32, torch.float32, device, block_size=32, seed=11)
    _check(batch, torch.float32, None, assert_close, references)


def test_choose_num_kv_splits() -> None:
    # Few long decodes: enough splits to approach 128 programs, at least 512 keys each.
    assert (
        choose_num_kv_splits(num_seqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=16384) == 16
    )
    assert choose_num_kv_splits(2, 8, 1, 4096) == 8
    assert choose_num_kv_splits(4, 8, 1, 16384) == 4
    assert choose_num_kv_splits(2, 8, 1, 1500) == 2
    # Short contexts, many programs already, or prefill queries: no split.
    assert choose_num_kv_splits(2, 8, 1, 700) == 1
    assert choose_num_kv_splits(64, 8, 1, 16384) == 1
    assert choose_num_kv_splits(1, 8, 512, 16384) == 1


def _rejected(batch, match: str, **overrides) -> None:
    m = batch.metadata
    key_cache, value_cache = batch.kv_cache
    args = {
        "query": batch.query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "query_start_loc": m.query_start_loc,
        "seq_lens": m.seq_lens,
        "block_table": m.block_table,
        "scale": 0.1,
    }
    out = torch.full(
        args["query"].shape, float("nan"), dtype=args["query"].dtype, device=args["query"].device
    )
    kwargs = {"num_kv_splits": overrides.pop("num_kv_splits", None)}
    with pytest.raises(ValueError, match=match):
        unified_attention(**{**args, **overrides}, **kwargs, out=out)
    assert out.isnan().all(), "a rejected call launched"


def test_rejects_unsupported_inputs_before_launch(device, paged_batch) -> None:
    batch = paged_batch([2, 1], [5, 9], 4, 2, 32, torch.float32, device)
    key_cache, value_cache = batch.kv_cache
    big = paged_batch([2, 1], [5, 9], 2, 1, 288, torch.float32, device)
    _rejected(big, "head_size 288 .* at most 256")
    _rejected(
        batch,
        "key_cache has dtype torch.bfloat16, expected torch.float32",
        key_cache=key_cache.bfloat16(),
        value_cache=value_cache.bfloat16(),
    )
    # The same tensor stored with head_size strided: a layout the kernel does not know.
    transposed = batch.cache.transpose(-1, -2).contiguous().transpose(-1, -2)
    _rejected(
        batch,
        "contiguous last dimension",
        key_cache=transposed[:, 1, 0],
        value_cache=transposed[:, 1, 1],
    )
    _rejected(batch, "not a multiple of num_kv_heads", query=batch.query[:, :3])
    _rejected(
        batch,
        "dtype torch.float64",
        query=batch.query.double(),
        key_cache=key_cache.double(),
        value_cache=value_cache.double(),
    )
    _rejected(
        batch, "block_table must be int32 or int64", block_table=batch.metadata.block_table.float()
    )
    _rejected(
        batch, "all tensors must be on one device", seq_lens=batch.metadata.seq_lens.to("meta")
    )
    _rejected(batch, "num_kv_splits must be None or >= 1", num_kv_splits=0)
