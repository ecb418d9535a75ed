"""The Triton attention backend against the torch backend and a float64 reference, for
all three attention types: DECODER (one `forward` writes the step's keys at their slots
and attends, causal or not), ENCODER (over the step's own keys, no cache) and CROSS (over
keys `write_kv` stored in the cross blocks, nothing written)."""

from __future__ import annotations

import dataclasses
from itertools import accumulate

import pytest
import torch
from kvferry.engine.attention.backend import AttentionBackend, AttentionType
from kvferry.engine.attention.triton.split_kv import choose_num_kv_splits
from kvferry.engine.attention.triton_backend import TritonAttentionBackend

MIXED = ([1, 9, 1, 5, 1, 14], [13, 9, 37, 21, 70, 14])  # decodes, prefills, a chunk
NON_CAUSAL = ([7, 12, 3], [7, 12, 3])


def _expected_cache(paged_batch, batch_args: dict) -> torch.Tensor:
    """The cache after the step: the same batch with every key written up front."""
    return paged_batch(**{**batch_args, "prewrite": True}).cache


def _forward(
    backend, batch, scale: float, num_padding: int = 0, *, with_cache: bool = True,
    fused: bool = False,
) -> torch.Tensor:
    """`backend.forward` with `num_padding` extra rows after the real tokens (as a padded
    batch has): they must neither be written to the cache nor disturb the real rows.

    CROSS batches pass no keys. `fused`: query, key and value are views of one tensor, as
    a fused QKV projection leaves them. `with_cache=False` passes no KV cache at all.
    """

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.randn_like(x[:num_padding])])

    query, key, value = pad(batch.query), pad(batch.key), pad(batch.value)
    if fused:
        qkv = torch.cat([query, key, value], dim=1)
        ends = list(accumulate(x.shape[1] for x in (query, key, value)))
        query, key, value = qkv[:, : ends[0]], qkv[:, ends[0] : ends[1]], qkv[:, ends[1] :]
    if batch.metadata.attn_type is AttentionType.CROSS:
        key = value = None
    kv_cache = batch.kv_cache if with_cache else None
    output = backend.forward(query, key, value, kv_cache, batch.metadata, scale)
    assert output.shape[0] == batch.query.shape[0] + num_padding
    return output[: batch.query.shape[0]]


def _assert_same_cache(cache: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal element for element, NaN (a slot nothing owns or wrote) where `expected` is."""
    assert torch.equal(cache.isnan(), expected.isnan())
    assert torch.equal(cache.nan_to_num(), expected.nan_to_num())


CASES = [
    pytest.param(MIXED, (8, 2, 32), torch.float32, True, None, id="mixed-gqa4-fp32"),
    pytest.param(MIXED, (6, 2, 80), torch.bfloat16, True, 3, id="mixed-gqa3-d80-bf16-split3"),
    pytest.param(MIXED, (8, 1, 128), torch.float16, True, None, id="mixed-mqa-d128-fp16"),
    pytest.param(NON_CAUSAL, (4, 4, 16), torch.float32, False, None, id="noncausal-fp32"),
]


@pytest.mark.parametrize(("lengths", "heads", "dtype", "causal", "num_kv_splits"), CASES)
def test_forward_matches_the_torch_backend(
    device, lengths, heads, dtype, causal, num_kv_splits, paged_batch, assert_close, references
) -> None:
    batch_args = {
        "query_lens": lengths[0],
        "seq_lens": lengths[1],
        "num_heads": heads[0],
        "num_kv_heads": heads[1],
        "head_size": heads[2],
        "dtype": dtype,
        "device": device,
        "causal": causal,
        "prewrite": False,
        "seed": 5,
    }
    batch = paged_batch(**batch_args)
    scale = heads[2] ** -0.5
    backend = TritonAttentionBackend(num_kv_splits=num_kv_splits)
    output = _forward(backend, batch, scale, num_padding=2)
    # Every key landed in its slot and nothing else changed: NaN slots stay NaN.
    _assert_same_cache(batch.cache, _expected_cache(paged_batch, batch_args))
    naive, torch_backend = references
    assert_close(output, naive(batch, scale), dtype, "against the float64 reference")
    assert_close(output, torch_backend(batch, scale), dtype, "against the torch backend")


def test_padding_slots_are_skipped(device, paged_batch, assert_close, references) -> None:
    # The first token of each request is marked as padding (-1): its key is not stored,
    # and the cache keeps NaN there.
    batch = paged_batch([3, 4], [3, 9], 4, 2, 16, torch.float32, device, prewrite=False)
    slots = batch.metadata.slot_mapping.clone()
    starts = torch.from_numpy(batch.metadata.query_start_loc_np[:-1]).long()
    dropped = slots[starts.to(slots.device)].cpu()
    slots[starts.to(slots.device)] = -1
    metadata = dataclasses.replace(batch.metadata, slot_mapping=slots)
    TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache, metadata, 0.25
    )
    key_cache = batch.kv_cache[0].cpu()
    block_size = key_cache.shape[1]
    for slot in dropped.tolist():
        assert key_cache[slot // block_size, slot % block_size].isnan().all()
    written = [s for s in slots.tolist() if s >= 0]
    assert all(key_cache[s // block_size, s % block_size].isfinite().all() for s in written)


def test_is_a_backend_built_like_the_torch_one() -> None:
    backend = TritonAttentionBackend()
    assert isinstance(backend, AttentionBackend)
    assert backend.name == "triton"


# Encoder inputs whose lengths cross key tiles (32 keys under the interpreter, 16 to 64 on
# a GPU) and query blocks (70 spans three tiles), beside a single position.
ENCODER_LENS = [33, 1, 70, 16]
# Decoder queries over their request's cached encoder keys: single tokens beside prompts
# shorter and longer than the encoder input (40 queries over 21 keys).
CROSS = ([1, 12, 1, 40, 1], [70, 33, 9, 21, 4])
# A decode-only cross step over Whisper-length encoder keys (1500 positions): few
# programs, so the heuristic splits the keys.
CROSS_DECODE = ([1, 1, 1], [1500, 700, 1])

ENCODER_CASES = [  # (num_heads, num_kv_heads, head_size), dtype, num_kv_splits, with_cache
    pytest.param((8, 2, 32), torch.float32, None, False, id="gqa4-fp32-nocache"),
    pytest.param((6, 2, 80), torch.bfloat16, 3, True, id="gqa3-d80-bf16-split3"),
    pytest.param((8, 1, 128), torch.float16, None, True, id="mqa-d128-fp16"),
]


@pytest.mark.parametrize(("heads", "dtype", "num_kv_splits", "with_cache"), ENCODER_CASES)
def test_encoder_attends_over_its_own_keys_and_caches_nothing(
    device, heads, dtype, num_kv_splits, with_cache, paged_batch, assert_close, references
) -> None:
    # The metadata keeps its real slots, block table and seq_lens (and causal=True): a
    # backend that stored the keys, read the all-NaN cache or masked causally would show.
    batch = paged_batch(
        ENCODER_LENS, ENCODER_LENS, *heads, dtype, device, attn_type=AttentionType.ENCODER,
        prewrite=False, seed=21,
    )
    assert batch.metadata.causal and batch.cache.isnan().all()
    before = batch.cache.clone()
    scale = heads[2] ** -0.5
    backend = TritonAttentionBackend(num_kv_splits=num_kv_splits)
    output = _forward(backend, batch, scale, num_padding=2, with_cache=with_cache, fused=True)
    _assert_same_cache(batch.cache, before)
    naive, torch_backend = references
    assert_close(output, naive(batch, scale), dtype, "against the float64 reference")
    assert_close(output, torch_backend(batch, scale), dtype, "against the torch backend")


CROSS_CASES = [  # lengths, (num_heads, num_kv_heads, head_size), dtype, splits, block_size
    pytest.param(CROSS, (8, 2, 32), torch.float32, None, 4, id="gqa4-fp32"),
    pytest.param(CROSS, (6, 2, 80), torch.bfloat16, 3, 16, id="gqa3-d80-bf16-split3-bs16"),
    pytest.param(CROSS, (8, 1, 128), torch.float16, 2, 4, id="mqa-d128-fp16-split2"),
    pytest.param(CROSS_DECODE, (8, 2, 32), torch.float32, None, 32, id="decode-1500-heuristic"),
]


@pytest.mark.parametrize(("lengths", "heads", "dtype", "num_kv_splits", "block_size"), CROSS_CASES)
def test_cross_attention_reads_the_cross_blocks_and_writes_nothing(
    device, lengths, heads, dtype, num_kv_splits, block_size, paged_batch, assert_close,
    references,
) -> None:
    batch = paged_batch(
        *lengths, *heads, dtype, device, attn_type=AttentionType.CROSS, writes_keys=False,
        block_size=block_size, seed=31,
    )
    assert batch.metadata.causal  # the type, not the flag, makes it non-causal
    before = batch.cache.clone()
    scale = heads[2] ** -0.5
    backend = TritonAttentionBackend(num_kv_splits=num_kv_splits)
    output = _forward(backend, batch, scale, num_padding=2)
    _assert_same_cache(batch.cache, before)
    naive, torch_backend = references
    assert_close(output, naive(batch, scale), dtype, "against the float64 reference")
    assert_close(output, torch_backend(batch, scale), dtype, "against the torch backend")


def test_decode_only_cross_steps_split_their_keys() -> None:
    # What makes the decode-1500-heuristic case above run the split-KV path.
    m = CROSS_DECODE
    assert choose_num_kv_splits(len(m[0]), 2, max(m[0]), max(m[1])) > 1


def _encoder_rows(batch, num_padding: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every request's keys and values in position order with the slots of its cross
    blocks, as an encoder step writes them, plus `num_padding` rows of garbage with slot -1
    after each request. Keys and values are views of one fused tensor."""
    block_size = batch.kv_cache[0].shape[1]
    table = batch.metadata.block_table.cpu()
    gen = torch.Generator().manual_seed(2)
    rows, slots = [], []
    for i, (k, v) in enumerate(zip(batch.keys, batch.values)):
        positions = torch.arange(k.shape[0])
        slots += [table[i, positions // block_size].long() * block_size + positions % block_size,
                  torch.full((num_padding,), -1)]
        garbage = 100 * torch.randn(num_padding, 2 * k.shape[1], k.shape[2], generator=gen)
        rows += [torch.cat([k, v], dim=1), garbage.to(k.dtype)]
    kv = torch.cat(rows).to(batch.cache.device)  # (num_rows, 2 * num_kv_heads, head_size)
    num_kv_heads = batch.keys[0].shape[1]
    return kv[:, :num_kv_heads], kv[:, num_kv_heads:], torch.cat(slots).to(kv.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_write_kv_stores_the_cross_keys_that_cross_attention_reads(
    device, dtype, paged_batch, assert_close, references
) -> None:
    # The cache as an encoder step must leave it: every encoder key in its cross slot.
    expected = paged_batch(
        *CROSS, 8, 2, 32, dtype, device, attn_type=AttentionType.CROSS, writes_keys=False,
        seed=41,
    )
    batch = dataclasses.replace(expected, cache=torch.full_like(expected.cache, float("nan")))
    key, value, slots = _encoder_rows(batch, num_padding=2)
    assert (slots < 0).sum() == 2 * len(batch.keys)
    backend = TritonAttentionBackend()
    backend.write_kv(key, value, batch.kv_cache, slots)
    # Exactly the owned slots hold their keys; the -1 rows wrote nothing (not even into
    # the null block 0), the other layer and the tails of last blocks stay NaN.
    _assert_same_cache(batch.cache, expected.cache)
    scale = 32**-0.5
    output = _forward(backend, batch, scale)
    naive, torch_backend = references
    assert_close(output, naive(batch, scale), dtype, "against the float64 reference")
    assert_close(output, torch_backend(batch, scale), dtype, "against the torch backend")


def test_rejects_a_missing_cache_or_missing_keys(device, paged_batch) -> None:
    batch = paged_batch([2, 1], [5, 9], 4, 2, 16, torch.float32, device)
    backend = TritonAttentionBackend()
    with pytest.raises(ValueError, match="decoder attention needs the layer's KV cache"):
        backend.forward(batch.query, batch.key, batch.value, None, batch.metadata, 0.25)
    encoder = dataclasses.replace(batch.metadata, attn_type=AttentionType.ENCODER)
    with pytest.raises(ValueError, match="encoder attention needs the step's keys and values"):
        backend.forward(batch.query, None, None, None, encoder, 0.25)


def test_encoder_metadata_without_blocks_or_slots(device, paged_batch, assert_close, references):
    # The runner's encoder pass has no block table columns and no slots at all.
    batch = paged_batch([9, 40], [9, 40], 6, 3, 16, torch.float32, device,
                        attn_type=AttentionType.ENCODER, prewrite=False, seed=51)
    m = batch.metadata
    batch.metadata = dataclasses.replace(
        m, block_table=m.block_table[:, :0], slot_mapping=m.slot_mapping[:0]
    )
    output = _forward(TritonAttentionBackend(), batch, 0.25, with_cache=False)
    naive, _ = references
    assert_close(output, naive(batch, 0.25), torch.float32, "against the float64 reference")
