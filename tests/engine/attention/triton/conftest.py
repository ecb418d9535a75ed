"""Fixtures of the Triton kernel tests: the devices they run on, the error metric, and a
factory of paged batches with a float64 attention reference over their logical keys.

Every test that takes `device` runs on the CPU under Triton's interpreter (where kernels
are interpreted, i.e. no GPU: see tests/conftest.py) and, marked `gpu`, on CUDA where a
GPU exists. Without CUDA the `gpu` variants skip with one line saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from kvferry.engine.attention.backend import AttentionMetadata, AttentionType, KVCacheView
from kvferry.engine.attention.torch_backend import TorchAttentionBackend
from kvferry.engine.attention.triton._runtime import is_interpreted
from kvferry.engine.attention.triton.activation import _silu_and_mul_kernel

# Relative-norm error allowed against a float32 (or float64) reference, by storage dtype.
# Half types round every stored value (and under the interpreter bfloat16 rounds toward
# zero), which the references do not.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}

_CUDA = pytest.param(
    "cuda",
    id="cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
    ],
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" in metafunc.fixturenames:
        interpreted = is_interpreted(_silu_and_mul_kernel)
        devices = ([pytest.param("cpu", id="cpu")] if interpreted else []) + [_CUDA]
        metafunc.parametrize("device", devices)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """`||actual - expected|| / ||expected||`, computed in float64 on the CPU."""
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


@pytest.fixture
def assert_close() -> Callable[..., None]:
    """Asserts every element is finite (nothing left unwritten in a NaN-poisoned output)
    and the relative-norm error is within the tolerance of `dtype`."""

    def check(
        actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "output"
    ) -> None:
        assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
        unwritten = int((~torch.isfinite(actual)).sum())
        assert unwritten == 0, f"{what}: {unwritten} elements not finite (never written?)"
        error = relative_error(actual, expected)
        assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.3g} for {dtype}"

    return check


# Enough blocks for the largest batch the tests build (6 requests of up to 79 keys in
# blocks of 4). Block 0 is the null block; the last block is never handed out either,
# because the torch backend stores a -1 (padding) slot there instead of skipping it.
NUM_BLOCKS, NUM_LAYERS, LAYER = 160, 2, 1


@dataclass
class PagedBatch:
    """One step's flat batch over a paged cache, and the keys each request must attend over."""

    query: torch.Tensor  # (num_tokens, num_heads, head_size)
    # This step's keys and values, for metadata.slot_mapping (-1: a token writes nothing).
    key: torch.Tensor  # (num_tokens, num_kv_heads, head_size)
    value: torch.Tensor  # (num_tokens, num_kv_heads, head_size)
    # [NUM_BLOCKS, NUM_LAYERS, 2, block_size, num_kv_heads, head_size]. Slots no request
    # owns (the null block 0, block tails past seq_len, the other layer) hold NaN.
    cache: torch.Tensor
    metadata: AttentionMetadata
    # Per request, (seq_len, num_kv_heads, head_size): its keys and values in position order.
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def kv_cache(self) -> KVCacheView:
        return self.cache[:, LAYER, 0], self.cache[:, LAYER, 1]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_ids(
    seq_lens: list[int], block_size: int, num_shared: int, gen: torch.Generator
) -> list[list[int]]:
    """Random, non-consecutive blocks per request (never the null block 0 nor the last
    block); every request after the first reuses the first's first `num_shared` blocks."""
    free = (torch.randperm(NUM_BLOCKS - 2, generator=gen) + 1).tolist()
    tables: list[list[int]] = []
    for seq_len in seq_lens:
        shared = tables[0][:num_shared] if tables else []
        num_new = _cdiv(seq_len, block_size) - len(shared)
        tables.append(shared + [free.pop() for _ in range(num_new)])
    return tables


def _logical_kv(
    seq_lens: list[int], shape: tuple[int, int], num_shared_keys: int, gen: torch.Generator
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    keys = [torch.randn(n, *shape, generator=gen) for n in seq_lens]
    values = [torch.randn(n, *shape, generator=gen) for n in seq_lens]
    shared = slice(0, num_shared_keys)
    for k, v in zip(keys[1:], values[1:]):  # a shared prefix has the same content
        k[shared], v[shared] = keys[0][shared], values[0][shared]
    return keys, values


def _metadata(
    query_lens: list[int],
    seq_lens: list[int],
    tables: list[list[int]],
    slots: list[int],
    causal: bool,
    attn_type: AttentionType,
    device: str,
) -> AttentionMetadata:
    # The block table is a view of a wider persistent table: its rows are not contiguous,
    # and entries past each request's blocks are the null block 0.
    table = torch.zeros(len(seq_lens) + 1, max(map(len, tables)) + 2, dtype=torch.int32)
    for row, blocks in enumerate(tables):
        table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens_np = np.array(seq_lens, dtype=np.int32)
    return AttentionMetadata(
        num_reqs=len(seq_lens),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens_np).to(device),
        block_table=table.to(device)[: len(seq_lens), : max(map(len, tables))],
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_np=query_start_loc,
        seq_lens_np=seq_lens_np,
        causal=causal,
        attn_type=attn_type,
    )


def _place_keys(
    cache: torch.Tensor,
    new_kv: tuple[torch.Tensor, torch.Tensor],
    logical_kv: tuple[list[torch.Tensor], list[torch.Tensor]],
    tables: list[list[int]],
    query_lens: list[int],
    writes_keys: bool,
    prewrite: bool,
) -> list[int]:
    """Writes every request's cached positions into `cache` and the step's new keys and
    values into `new_kv`; returns the slot of every token (-1: it writes nothing)."""
    block_size = cache.shape[3]
    slots: list[int] = []
    for blocks, q_len, k, v in zip(tables, query_lens, *logical_kv):
        seq_len = k.shape[0]
        first_new = seq_len - q_len if writes_keys else seq_len
        for pos in range(seq_len):
            if pos < first_new or prewrite:
                block, offset = blocks[pos // block_size], pos % block_size
                cache[block, LAYER, 0, offset], cache[block, LAYER, 1, offset] = k[pos], v[pos]
        for pos in range(seq_len - q_len, seq_len):
            is_new = writes_keys and pos >= 0
            slot = blocks[pos // block_size] * block_size + pos % block_size if is_new else -1
            if is_new:
                new_kv[0][len(slots)], new_kv[1][len(slots)] = k[pos], v[pos]
            slots.append(slot)
    return slots


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: str,
    *,
    causal: bool = True,
    attn_type: AttentionType = AttentionType.DECODER,
    block_size: int = 4,
    num_shared_blocks: int = 0,
    writes_keys: bool = True,
    prewrite: bool = True,
    seed: int = 0,
) -> PagedBatch:
    """A batch where request i has `query_lens[i]` queries and `seq_lens[i]` keys.

    `writes_keys`: token j of request i brings the key at position seq_len - query_len + j
    (causal steps, encoder self-attention); otherwise (cross-attention) every slot is -1
    and all keys are already cached. `prewrite`: the step's own keys are in the cache too
    (for calling the attention kernel alone); otherwise only earlier positions are.
    `attn_type` only labels the metadata: an ENCODER batch has `query_lens == seq_lens`
    (every key is the step's own), a CROSS batch `writes_keys=False`.
    """
    gen = torch.Generator().manual_seed(seed)
    tables = _block_ids(seq_lens, block_size, num_shared_blocks, gen)
    shape = (num_kv_heads, head_size)
    keys, values = _logical_kv(seq_lens, shape, num_shared_blocks * block_size, gen)
    keys, values = [k.to(dtype) for k in keys], [v.to(dtype) for v in values]
    num_tokens = sum(query_lens)
    query = 2 * torch.randn(num_tokens, num_heads, head_size, generator=gen)
    key = torch.randn(num_tokens, *shape, generator=gen).to(dtype)
    value = torch.randn(num_tokens, *shape, generator=gen).to(dtype)
    cache_shape = (NUM_BLOCKS, NUM_LAYERS, 2, block_size, *shape)
    cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    slots = _place_keys(
        cache, (key, value), (keys, values), tables, query_lens, writes_keys, prewrite
    )
    return PagedBatch(
        query=query.to(device, dtype),
        key=key.to(device),
        value=value.to(device),
        cache=cache.to(device),
        metadata=_metadata(query_lens, seq_lens, tables, slots, causal, attn_type, device),
        keys=keys,
        values=values,
    )


def naive_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """Float64 attention of each query over its request's logical keys, one query at a time
    (no paging, no masks): the ground truth for every implementation."""
    query = batch.query.cpu().double()
    out = torch.empty_like(query)  # (num_tokens, num_heads, head_size)
    group = query.shape[1] // batch.keys[0].shape[1]
    starts = batch.metadata.query_start_loc_np
    for i, (k, v) in enumerate(zip(batch.keys, batch.values)):
        k = k.double().repeat_interleave(group, dim=1)  # (seq_len, num_heads, head_size)
        v = v.double().repeat_interleave(group, dim=1)
        q_len = int(starts[i + 1] - starts[i])
        for j in range(q_len):
            visible = k.shape[0] - q_len + j + 1 if batch.metadata.is_causal else k.shape[0]
            scores = torch.einsum("hd,khd->hk", query[starts[i] + j], k[:visible]) * scale
            out[starts[i] + j] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[:visible])
    return out


def torch_backend_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """The torch backend's output for `batch`, run on the CPU over a copy of the cache
    whose unowned slots hold large finite garbage instead of NaN: its decode path reads
    whole blocks and masks scores, and 0 * NaN would poison it."""
    cache = batch.cache.cpu()
    garbage = 100 * torch.randn(cache.shape, generator=torch.Generator().manual_seed(0))
    cache = torch.where(cache.isnan(), garbage.to(cache.dtype), cache)
    m = batch.metadata
    metadata = AttentionMetadata(
        **{
            **vars(m),
            "query_start_loc": m.query_start_loc.cpu(),
            "seq_lens": m.seq_lens.cpu(),
            "block_table": m.block_table.cpu(),
            "slot_mapping": m.slot_mapping.cpu(),
        }
    )
    kv_cache = (cache[:, LAYER, 0], cache[:, LAYER, 1])
    return TorchAttentionBackend().forward(
        batch.query.cpu(), batch.key.cpu(), batch.value.cpu(), kv_cache, metadata, scale
    )


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    """`make_paged_batch`, the factory of paged batches."""
    return make_paged_batch


@pytest.fixture
def references() -> tuple[Callable[[PagedBatch, float], torch.Tensor], ...]:
    """`(naive_attention, torch_backend_attention)`: what attention over a PagedBatch is
    compared with beside the kernel's own torch reference."""
    return naive_attention, torch_backend_attention
