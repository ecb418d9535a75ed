"""Fixtures for model tests: a paged KV cache and hand-built attention metadata."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvferry.engine.attention.backend import AttentionMetadata, KVCacheView


def build_metadata(
    block_table: np.ndarray,  # (num_reqs, max_blocks_per_req) int32
    num_computed: list[int],
    num_new: list[int],
    block_size: int,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions for requests that each add `num_new` tokens after
    `num_computed` cached ones. Example: computed [0, 3], new [2, 1], block size 2,
    blocks [[5, 0], [7, 2]] -> positions [0, 1, 3], slots [10, 11, 2*2+1=5]."""
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(num_computed, num_new)]).astype(
        np.int64
    )
    req_indices = np.repeat(np.arange(len(num_new)), num_new)
    blocks = block_table[req_indices, positions // block_size].astype(np.int64)
    slot_mapping = blocks * block_size + positions % block_size
    query_start_loc = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
    seq_lens = (np.asarray(num_computed) + np.asarray(num_new)).astype(np.int32)
    metadata = AttentionMetadata(
        num_reqs=len(num_new),
        num_actual_tokens=int(query_start_loc[-1]),
        max_query_len=int(max(num_new)),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.from_numpy(query_start_loc),
        seq_lens=torch.from_numpy(seq_lens),
        block_table=torch.from_numpy(block_table.astype(np.int32)),
        slot_mapping=torch.from_numpy(slot_mapping),
        query_start_loc_np=query_start_loc,
        seq_lens_np=seq_lens,
    )
    return metadata, torch.from_numpy(positions)


class PagedRun:
    """Runs a model over several requests, step by step, through one paged KV cache.

    Requests get distinct, shuffled blocks (block 0, the null block, is never handed
    out), so a slot-mapping or block-table mistake reads the wrong keys.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_reqs: int,
        max_len: int,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        config = model.config
        self.model = model
        self.block_size = block_size
        blocks_per_req = -(-max_len // block_size)
        num_blocks = 1 + num_reqs * blocks_per_req
        shuffled = np.random.default_rng(0).permutation(np.arange(1, num_blocks))
        self.block_table = shuffled.reshape(num_reqs, blocks_per_req).astype(np.int32)
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]
        self.cache = torch.zeros(
            num_blocks,
            config.num_layers,
            2,
            block_size,
            config.num_kv_heads,
            config.head_size,
            dtype=dtype,
        )
        self.kv_caches: list[KVCacheView] = [
            (self.cache[:, i, 0], self.cache[:, i, 1]) for i in range(config.num_layers)
        ]
        self.num_computed = [0] * num_reqs

    def step(
        self, new_tokens: list[list[int]], inputs_embeds: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Feeds each request its new tokens as one flat batch; returns per-request logits.

        With `inputs_embeds` (num_tokens, hidden_size) the model reads those instead of
        the token ids (which then only set the lengths)."""
        num_new = [len(t) for t in new_tokens]
        metadata, positions = build_metadata(
            self.block_table, self.num_computed, num_new, self.block_size
        )
        input_ids = torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.int64)
        with torch.inference_mode():
            ids = None if inputs_embeds is not None else input_ids
            hidden = self.model(ids, positions, self.kv_caches, metadata, inputs_embeds)
            logits = self.model.compute_logits(hidden)  # (num_tokens, vocab_size)
        self.num_computed = [c + n for c, n in zip(self.num_computed, num_new)]
        return list(logits.split(num_new))


@pytest.fixture
def paged_run() -> Callable[..., PagedRun]:
    return PagedRun


@pytest.fixture(scope="session")
def hf_logits(
    hf_model: Callable[..., torch.nn.Module],
) -> Callable[[Path, list[int]], torch.Tensor]:
    """HF logits (seq_len, vocab_size) float32 of one token sequence of a checkpoint."""
    models: dict[Path, torch.nn.Module] = {}

    def run(path: Path, token_ids: list[int]) -> torch.Tensor:
        if path not in models:
            models[path] = hf_model(path)
        with torch.inference_mode():
            out = models[path](torch.tensor([token_ids]))
        return out.logits[0].float()

    return run
