"""The Triton attention backend against the torch backend and a float64 reference: one
`forward` writes the step's keys at their slots and attends, causal or not."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvferry.engine.attention.backend import AttentionBackend
from kvferry.engine.attention.triton_backend import TritonAttentionBackend

MIXED = ([1, 9, 1, 5, 1, 14], [13, 9, 37, 21, 70, 14])  # decodes, prefills, a chunk
ENCODER = ([7, 12, 3], [7, 12, 3])
CROSS = ([3, 1, 6], [20, 33, 9])


def _expected_cache(paged_batch, batch_args: dict) -> torch.Tensor:
    """The cache after the step: the same batch with every key written up front."""
    return paged_batch(**{**batch_args, "prewrite": True}).cache


def _forward(backend, batch, scale: float, num_padding: int = 0) -> torch.Tensor:
    """`backend.forward` with `num_padding` extra rows after the real tokens (as a padded
    batch has): they must neither be written to the cache nor disturb the real rows."""

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.randn_like(x[:num_padding])])

    output = backend.forward(
        pad(batch.query), pad(batch.key), pad(batch.value), batch.kv_cache, batch.metadata, scale
    )
    assert output.shape[0] == batch.query.shape[0] + num_padding
    return output[: batch.query.shape[0]]


CASES = [
    pytest.param(MIXED, (8, 2, 32), torch.float32, True, None, id="mixed-gqa4-fp32"),
    pytest.param(MIXED, (6, 2, 80), torch.bfloat16, True, 3, id="mixed-gqa3-d80-bf16-split3"),
    pytest.param(MIXED, (8, 1, 128), torch.float16, True, None, id="mixed-mqa-d128-fp16"),
    pytest.param(ENCODER, (4, 4, 16), torch.float32, False, None, id="encoder-fp32"),
    pytest.param(CROSS, (8, 2, 32), torch.float32, False, 2, id="cross-fp32-split2"),
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
        "writes_keys": lengths is not CROSS,
        "prewrite": False,
        "seed": 5,
    }
    batch = paged_batch(**batch_args)
    scale = heads[2] ** -0.5
    backend = TritonAttentionBackend(num_kv_splits=num_kv_splits)
    output = _forward(backend, batch, scale, num_padding=2)
    # Every key landed in its slot and nothing else changed: NaN slots stay NaN.
    expected_cache = _expected_cache(paged_batch, batch_args)
    assert torch.equal(batch.cache.isnan(), expected_cache.isnan())
    assert torch.equal(batch.cache.nan_to_num(), expected_cache.nan_to_num())
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
