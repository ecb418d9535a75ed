"""The torch backend creates every tensor it uses on the queries' device.

Run on the `meta` device: an op that mixes a host tensor (say, a mask built on the CPU)
with meta tensors fails the same way it would fail on a GPU, so a CPU-only run catches it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvferry.engine.attention.backend import AttentionMetadata
from kvferry.engine.attention.torch_backend import TorchAttentionBackend

META = torch.device("meta")
BLOCK_SIZE = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 16


def meta_metadata(num_computed: list[int], num_new: list[int], causal: bool) -> AttentionMetadata:
    """Metadata whose tensors live on `meta` (host copies stay NumPy, as the runner makes)."""
    num_reqs = len(num_new)
    blocks_per_req = -(-max(c + n for c, n in zip(num_computed, num_new)) // BLOCK_SIZE)
    block_table = np.arange(1, 1 + num_reqs * blocks_per_req, dtype=np.int32).reshape(num_reqs, -1)
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(num_computed, num_new)])
    req_indices = np.repeat(np.arange(num_reqs), num_new)
    slots = block_table[req_indices, positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE \
        + positions % BLOCK_SIZE
    query_start_loc = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
    seq_lens = (np.asarray(num_computed) + np.asarray(num_new)).astype(np.int32)
    return AttentionMetadata(
        num_reqs=num_reqs, num_actual_tokens=int(query_start_loc[-1]),
        max_query_len=max(num_new), max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.from_numpy(query_start_loc).to(META),
        seq_lens=torch.from_numpy(seq_lens).to(META),
        block_table=torch.from_numpy(block_table).to(META),
        slot_mapping=torch.from_numpy(slots).to(META),
        query_start_loc_np=query_start_loc, seq_lens_np=seq_lens, causal=causal,
    )


@pytest.mark.parametrize(
    ("num_computed", "num_new", "causal"),
    [
        ([5, 9, 2, 0, 7, 3, 11, 6, 1], [1] * 9, True),  # decodes only, in length buckets
        ([0, 5, 9, 3], [6, 1, 1, 4], True),  # a prefill, decodes, a chunk over a cached prefix
        ([0, 0], [7, 3], False),  # encoder-style attention: every query sees every key
    ],
)
def test_every_path_stays_on_the_queries_device(
    num_computed: list[int], num_new: list[int], causal: bool
) -> None:
    metadata = meta_metadata(num_computed, num_new, causal)
    num_blocks = 1 + int(metadata.block_table.numel())
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]
    cache = torch.empty(num_blocks, 2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device=META)
    num_tokens = metadata.num_actual_tokens
    query = torch.empty(num_tokens, NUM_HEADS, HEAD_SIZE, device=META)
    key = torch.empty(num_tokens, NUM_KV_HEADS, HEAD_SIZE, device=META)
    value = torch.empty(num_tokens, NUM_KV_HEADS, HEAD_SIZE, device=META)

    out = TorchAttentionBackend().forward(
        query, key, value, (cache[:, 1, 0], cache[:, 1, 1]), metadata, HEAD_SIZE**-0.5)

    assert out.device == META
    assert out.shape == (num_tokens, NUM_HEADS, HEAD_SIZE)
