"""Encoder self-attention (the unified kernel reading the step's own keys in place)
against its torch reference and a float64 dense reference: requests of different lengths
never see each other's keys, nothing is masked causally, memory stays linear."""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch
from kvferry.engine.attention.triton.encoder_attention import (
    encoder_attention,
    encoder_attention_reference,
)

# Lengths crossing key tiles (32 keys under the interpreter, 16 to 64 on a GPU) and query
# blocks, a single position, and 70 (three tiles) beside 100 (four).
LENGTHS = [33, 1, 70, 16, 100]

HEADS = {  # (num_heads, num_kv_heads, head_size)
    "mha-d16": (4, 4, 16),
    "gqa4-d32": (8, 2, 32),
    "gqa3-d80": (6, 2, 80),
    "mqa8-d128": (8, 1, 128),
}


def _batch(
    lengths: list[int], heads: tuple[int, int, int], dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, key, value, query_start_loc): the three as views of one fused projection
    output (num_tokens, num_heads + 2 * num_kv_heads, head_size), as a model leaves them."""
    num_heads, num_kv_heads, head_size = heads
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), num_heads + 2 * num_kv_heads, head_size, generator=gen)
    qkv = qkv.to(device, dtype)
    query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    starts = torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device=device)
    return query, key, value, starts


def _check(lengths, heads, dtype, device, num_kv_splits, assert_close) -> None:
    query, key, value, starts = _batch(lengths, heads, dtype, device, seed=sum(heads))
    scale = heads[2] ** -0.5
    out = torch.full_like(query, float("nan"))  # every element must be written
    result = encoder_attention(
        query, key, value, starts, scale, max_query_len=max(lengths),
        num_kv_splits=num_kv_splits, out=out,
    )
    assert result is out
    expected = encoder_attention_reference(query, key, value, starts, scale)
    assert_close(out, expected, dtype, "against the torch reference")
    exact = encoder_attention_reference(query.double(), key.double(), value.double(), starts,
                                        scale)
    assert_close(out, exact, dtype, "against the float64 reference")


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_float32(device, heads, assert_close) -> None:
    _check(LENGTHS, heads, torch.float32, device, 1, assert_close)


@pytest.mark.parametrize("num_kv_splits", [2, 3], ids=["split2", "split3"])
def test_split_kv(device, num_kv_splits, assert_close) -> None:
    # Only forced: the heuristic never splits encoder attention (as many keys as queries).
    # A split range may hold none of a short request's keys: it must weigh nothing.
    _check(LENGTHS[:4], HEADS["gqa4-d32"], torch.float32, device, num_kv_splits, assert_close)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads", ["gqa3-d80", "mqa8-d128"])
def test_half(device, heads, dtype, assert_close) -> None:
    _check(LENGTHS[:4], HEADS[heads], dtype, device, None, assert_close)


def test_each_request_as_if_alone(device) -> None:
    # A program reading a neighbour's rows would change its request's output.
    lengths = [20, 40, 5]
    query, key, value, starts = _batch(lengths, HEADS["gqa4-d32"], torch.float32, device, 3)
    out = encoder_attention(query, key, value, starts, 32**-0.5)
    for start, end in zip(starts[:-1].tolist(), starts[1:].tolist()):
        alone = torch.tensor([0, end - start], dtype=torch.int32, device=device)
        rows = slice(start, end)
        expected = encoder_attention(query[rows], key[rows], value[rows], alone, 32**-0.5)
        torch.testing.assert_close(out[rows], expected, rtol=1e-5, atol=1e-6)


def test_a_whisper_length_input(device, assert_close) -> None:
    # A Whisper encoder attends over 1500 positions per request; the interpreter runs a
    # shorter one that still spans many query blocks and key tiles. On a GPU the launch
    # must allocate nothing beyond the output: no score matrix.
    length = 1500 if device == "cuda" else 300
    heads = (8, 8, 64)
    query, key, value, starts = _batch([length, 7], heads, torch.float16, device, seed=1)
    out = torch.empty_like(query)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    encoder_attention(query, key, value, starts, 64**-0.5, max_query_len=length, out=out)
    if device == "cuda":
        # One (heads, length, length) score matrix would be 8 * 1500^2 * 2 bytes = 36 MB.
        assert torch.cuda.max_memory_allocated() - before <= out.numel() * out.element_size()
    expected = encoder_attention_reference(query, key, value, starts, 64**-0.5)
    assert_close(out, expected, torch.float16, "against the torch reference")


def test_empty_batch_launches_nothing(device) -> None:
    query, key, value, _ = _batch([4], HEADS["mha-d16"], torch.float32, device, seed=0)
    out = torch.full_like(query[:0], float("nan"))
    starts = torch.zeros(1, dtype=torch.int32, device=device)
    assert encoder_attention(query[:0], key[:0], value[:0], starts, 0.25, out=out) is out


def test_rejects_unsupported_inputs_before_launch(device) -> None:
    query, key, value, starts = _batch([3, 5], HEADS["gqa4-d32"], torch.float32, device, 0)
    cases = [
        ({"key": key[:4]}, "key and value \\(num_tokens"),
        ({"value": value[:, :1]}, "key and value \\(num_tokens"),
        ({"query": query[:, :3]}, "not a multiple of num_kv_heads"),
        ({"key": key[..., :16], "value": value[..., :16]}, "head_size 32 \\(keys: 16\\)"),
        ({"key": key.half(), "value": value.half()}, "key has dtype torch.float16"),
        ({"key": key.transpose(0, 2).contiguous().transpose(0, 2)}, "contiguous last"),
        ({"query_start_loc": starts.float()}, "query_start_loc must be int32 or int64"),
        ({"query_start_loc": starts.to("meta")}, "all tensors must be on one device"),
        ({"num_kv_splits": 0}, "num_kv_splits must be None or >= 1"),
    ]
    for overrides, match in cases:
        args = {"query": query, "key": key, "value": value, "query_start_loc": starts}
        out = torch.full_like(query, float("nan"))
        with pytest.raises(ValueError, match=match):
            encoder_attention(**{**args, **overrides}, scale=0.1, out=out)
        assert out.isnan().all(), f"a rejected call ({match}) launched"
