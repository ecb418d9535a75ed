"""Fixtures for model tests: a paged KV cache and hand-built attention metadata (decoder-only
models: `paged_run`; encoder-decoder models: `encdec_run`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvferry.engine.attention.backend import AttentionMetadata, AttentionType, KVCacheView


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

    def step_metadata(self, num_new: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        """DECODER metadata (with its CROSS `cross`) and positions of a step that adds
        `num_new` decoder tokens to each request."""
        metadata, positions = build_metadata(
            self.block_table, self.num_computed, num_new, self.block_size
        )
        metadata.cross = cross_metadata(metadata, self.cross_block_table, self.encoder_lens)
        return metadata, positions

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


def cross_metadata(
    decoder: AttentionMetadata,
    cross_block_table: np.ndarray,  # (num_reqs, max_cross_blocks) int32
    encoder_lens: list[int],
) -> AttentionMetadata:
    """The CROSS metadata of a decoder step: the step's query rows over each request's
    encoder keys (`encoder_lens`) in its cross blocks; nothing is written."""
    seq_lens = np.asarray(encoder_lens, dtype=np.int32)
    return AttentionMetadata(
        num_reqs=decoder.num_reqs,
        num_actual_tokens=decoder.num_actual_tokens,
        max_query_len=decoder.max_query_len,
        max_seq_len=int(seq_lens.max()),
        query_start_loc=decoder.query_start_loc,
        seq_lens=torch.from_numpy(seq_lens),
        block_table=torch.from_numpy(cross_block_table.astype(np.int32)),
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_start_loc_np=decoder.query_start_loc_np,
        seq_lens_np=seq_lens,
        causal=False,
        attn_type=AttentionType.CROSS,
    )


def encoder_metadata(encoder_lens: list[int]) -> AttentionMetadata:
    """ENCODER metadata of requests with `encoder_lens` positions each (no cache)."""
    query_start_loc = np.concatenate([[0], np.cumsum(encoder_lens)]).astype(np.int32)
    seq_lens = np.asarray(encoder_lens, dtype=np.int32)
    return AttentionMetadata(
        num_reqs=len(encoder_lens),
        num_actual_tokens=int(query_start_loc[-1]),
        max_query_len=int(seq_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.from_numpy(query_start_loc),
        seq_lens=torch.from_numpy(seq_lens),
        block_table=torch.zeros(len(encoder_lens), 1, dtype=torch.int32),
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_start_loc_np=query_start_loc,
        seq_lens_np=seq_lens,
        causal=False,
        attn_type=AttentionType.ENCODER,
    )


class EncDecRun:
    """Runs an encoder-decoder model over several requests through one paged KV cache:
    `encode` once (which writes each request's cross blocks), then decoder `step`s.

    Every request gets distinct, shuffled self-attention blocks and cross blocks from one
    pool (block 0, the null block, is never handed out), so a block-table or slot
    mistake reads another request's keys.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        encoder_lens: list[int],
        max_decoder_len: int,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        config = model.config
        self.model = model
        self.block_size = block_size
        self.encoder_lens = list(encoder_lens)
        num_reqs = len(encoder_lens)
        self_blocks = -(-max_decoder_len // block_size)
        cross_blocks = -(-max(encoder_lens) // block_size)
        num_blocks = 1 + num_reqs * (self_blocks + cross_blocks)
        shuffled = np.random.default_rng(1).permutation(np.arange(1, num_blocks)).astype(np.int32)
        self.block_table = shuffled[: num_reqs * self_blocks].reshape(num_reqs, self_blocks)
        self.cross_block_table = shuffled[num_reqs * self_blocks :].reshape(num_reqs, cross_blocks)
        # [num_blocks, num_decoder_layers, 2, block_size, num_heads, head_size]
        self.cache = torch.zeros(
            num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_size,
            dtype=dtype,
        )
        self.kv_caches: list[KVCacheView] = [
            (self.cache[:, i, 0], self.cache[:, i, 1]) for i in range(config.num_layers)
        ]
        self.num_computed = [0] * num_reqs

    def cross_slots(self) -> torch.Tensor:
        """(sum(encoder_lens),) int64: each encoder position's slot in its cross blocks."""
        positions = np.concatenate([np.arange(n) for n in self.encoder_lens])
        rows = np.repeat(np.arange(len(self.encoder_lens)), self.encoder_lens)
        blocks = self.cross_block_table[rows, positions // self.block_size].astype(np.int64)
        return torch.from_numpy(blocks * self.block_size + positions % self.block_size)

    def encoder_metadata(self) -> AttentionMetadata:
        return encoder_metadata(self.encoder_lens)

    def encode(self, **inputs: torch.Tensor) -> torch.Tensor:
        """Runs the encoder (EncoderBatch fields as keywords) and writes the cross KV;
        returns the encoder output (sum(encoder_lens), hidden_size)."""
        from kvferry.engine.models.encoder_decoder import EncoderBatch

        batch = EncoderBatch(metadata=self.encoder_metadata(), **inputs)
        with torch.inference_mode():
            hidden = self.model.encode(batch)
            self.model.write_cross_kv(hidden, self.kv_caches, self.cross_slots())
        return hidden

    def step_metadata(self, num_new: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        """DECODER metadata (with its CROSS `cross`) and positions of a step that adds
        `num_new` decoder tokens to each request."""
        metadata, positions = build_metadata(
            self.block_table, self.num_computed, num_new, self.block_size
        )
        metadata.cross = cross_metadata(metadata, self.cross_block_table, self.encoder_lens)
        return metadata, positions

    def step(
        self, new_tokens: list[list[int]], inputs_embeds: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Feeds each request its new decoder tokens as one flat batch; returns per-request
        logits (num_new, vocab_size)."""
        num_new = [len(t) for t in new_tokens]
        metadata, positions = self.step_metadata(num_new)
        input_ids = torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.int64)
        with torch.inference_mode():
            ids = None if inputs_embeds is not None else input_ids
            hidden = self.model(ids, positions, self.kv_caches, metadata, inputs_embeds)
            logits = self.model.compute_logits(hidden)  # (num_tokens, vocab_size)
        self.num_computed = [c + n for c, n in zip(self.num_computed, num_new)]
        return list(logits.split(num_new))

    def cross_kv(self, layer: int, req_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s cross keys and values of request `req_index`, each
        (encoder_len, num_heads, head_size), read back from its cross blocks."""
        n = self.encoder_lens[req_index]
        blocks = torch.from_numpy(self.cross_block_table[req_index]).long()
        keys = self.cache[blocks, layer, 0].flatten(0, 1)[:n]
        values = self.cache[blocks, layer, 1].flatten(0, 1)[:n]
        return keys, values


@pytest.fixture
def encdec_run() -> Callable[..., EncDecRun]:
    return EncDecRun
