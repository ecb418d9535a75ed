"""Rotary embedding kernel (in place, NeoX and GPT-J layouts) against its reference and the
engine's rotate-half `apply_rotary_emb`, with plain and Llama-3-scaled cos/sin tables."""

from __future__ import annotations

import pytest
import torch
from kvferry.engine.attention.triton.rotary import rotary_embedding, rotary_embedding_reference
from kvferry.engine.layers.rotary import RotaryEmbedding, apply_rotary_emb

MAX_POSITIONS = 4096
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


def _tables(rot_dim: int, scaling: dict | None, dtype: torch.dtype, device: str):
    rope = RotaryEmbedding(rot_dim, MAX_POSITIONS, 500000.0, scaling, dtype=dtype)
    return rope.cos_cache.to(device), rope.sin_cache.to(device)


def _qkv(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
):
    """Q, K and V as views of one fused projection, as the model splits them."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = torch.randn(num_tokens, width, generator=gen).to(device, dtype)
    q, k, v = qkv.split(
        [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1
    )
    shape = (num_tokens, -1, head_size)
    return qkv, q.view(shape), k.view(shape), v.view(shape)


CASES = [
    # (num_heads, num_kv_heads, head_size, rot_dim, dtype)
    (4, 2, 16, 16, torch.float32),
    (6, 2, 32, 32, torch.bfloat16),
    (4, 1, 80, 80, torch.float16),
    (2, 2, 128, 128, torch.float32),
    (4, 4, 80, 48, torch.bfloat16),  # partial rotary: the last 32 dims stay as they are
]


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["plain", "llama3"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_size", "rot_dim", "dtype"), CASES)
def test_matches_reference(
    device, is_neox, scaling, num_heads, num_kv_heads, head_size, rot_dim, dtype, assert_close
) -> None:
    gen = torch.Generator().manual_seed(head_size + rot_dim)
    positions = torch.randint(0, MAX_POSITIONS, (11,), generator=gen).to(device)
    cos, sin = _tables(rot_dim, scaling, dtype, device)
    _, q, k, v = _qkv(11, num_heads, num_kv_heads, head_size, dtype, device, seed=rot_dim)
    v_before = v.clone()
    expected_q, expected_k = rotary_embedding_reference(positions, q, k, cos, sin, is_neox)
    rotary_embedding(positions, q, k, cos, sin, is_neox)
    assert_close(q, expected_q, dtype, "query")
    assert_close(k, expected_k, dtype, "key")
    assert torch.equal(v, v_before), "the value part of the fused projection changed"
    rest = slice(rot_dim, head_size)
    assert torch.equal(q[..., rest], expected_q[..., rest]), "dims past rot_dim changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_neox_matches_the_engines_rotary_with_llama3_scaling(device, dtype, assert_close) -> None:
    positions = torch.tensor([0, 1, 17, 1023, 1024, 4095], device=device)
    cos, sin = _tables(64, LLAMA3_SCALING, dtype, device)
    _, q, k, _ = _qkv(6, 4, 2, 64, dtype, device, seed=5)
    expected_q = apply_rotary_emb(q, cos[positions], sin[positions])
    expected_k = apply_rotary_emb(k, cos[positions], sin[positions])
    rotary_embedding(positions, q, k, cos, sin, is_neox=True)
    assert_close(q, expected_q, dtype, "query")
    assert_close(k, expected_k, dtype, "key")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rounding_each_op_equals_the_engines_eager_rotary(device, dtype, assert_close) -> None:
    # The models' path: products and sums rounded to the half dtype one by one, as eager
    # PyTorch (and HF) compute rope, so the Triton layers give the torch backend's numbers.
    positions = torch.arange(7, 7 + 64, device=device)
    cos, sin = _tables(128, LLAMA3_SCALING, dtype, device)
    _, q, k, _ = _qkv(64, 8, 2, 128, dtype, device, seed=9)
    expected_q = apply_rotary_emb(q, cos[positions], sin[positions])
    expected_k = apply_rotary_emb(k, cos[positions], sin[positions])
    once_q, once_k = q.clone(), k.clone()
    rotary_embedding(positions, once_q, once_k, cos, sin, is_neox=True)
    rotary_embedding(positions, q, k, cos, sin, is_neox=True, round_each_op=True)
    if device == "cpu" and dtype == torch.bfloat16:
        # The interpreter rounds bfloat16 toward zero: only close (fp16 and CUDA: equal).
        assert_close(q, expected_q, dtype, "query")
    else:
        assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
        # Rounding once gives other numbers: the flag is what makes them equal.
        assert not torch.equal(once_q, expected_q)


def test_gptj_pairs_adjacent_dims(device) -> None:
    # One pair rotated by 90 degrees: GPT-J maps (x0, x1) -> (-x1, x0), NeoX pairs x0 with x2.
    cos = torch.tensor([[0.0, 1.0]], device=device)  # (1 position, rot_dim // 2 = 2)
    sin = torch.tensor([[1.0, 0.0]], device=device)
    positions = torch.zeros(1, dtype=torch.int64, device=device)
    gptj_q, neox_q = (torch.tensor([[[1.0, 2.0, 3.0, 4.0]]], device=device) for _ in "ab")
    rotary_embedding(positions, gptj_q, gptj_q.clone(), cos, sin, is_neox=False)
    assert gptj_q.flatten().tolist() == [-2.0, 1.0, 3.0, 4.0]
    rotary_embedding(positions, neox_q, neox_q.clone(), cos, sin, is_neox=True)
    assert neox_q.flatten().tolist() == [-3.0, 2.0, 1.0, 4.0]


def test_rejects_unsupported_inputs_before_launch(device) -> None:
    cos, sin = _tables(32, None, torch.float32, device)
    _, q, k, _ = _qkv(3, 4, 2, 32, torch.float32, device, seed=6)
    positions = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="rot_dim 32 exceeds head_size 16"):
        rotary_embedding(positions, q[..., :16], k[..., :16], cos, sin)
    with pytest.raises(ValueError, match="key has dtype torch.float16"):
        rotary_embedding(positions, q, k.half(), cos, sin)
    with pytest.raises(ValueError, match="positions must be int32 or int64"):
        rotary_embedding(positions.float(), q, k, cos, sin)
    with pytest.raises(ValueError, match="positions must be"):
        rotary_embedding(positions[:2], q, k, cos, sin)
