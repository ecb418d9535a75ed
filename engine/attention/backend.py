"""The interface every attention backend implements, and the metadata it reads.

All requests of a step run as one flat token batch with no padding between them
(seed 003): request `i` owns the query rows `query_start_loc[i]:query_start_loc[i+1]`,
and its keys are the first `seq_lens[i]` slots addressed by row `i` of `block_table`.
The newest `query_len` of those keys are the ones this step writes, at `slot_mapping`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

# One layer's paged cache: (key_cache, value_cache), each
# (num_blocks, block_size, num_kv_heads, head_size). Both are strided views of the
# engine's single cache tensor [num_blocks, num_layers, 2, block_size, num_kv_heads,
# head_size], so they are not contiguous: index them by (block, offset), never flatten.
KVCacheView = tuple[torch.Tensor, torch.Tensor]


@dataclass
class AttentionMetadata:
    """What a backend needs to run attention for one step's flat token batch."""

    num_reqs: int
    # Tokens in this step's batch (the sum of the query lengths).
    num_actual_tokens: int
    # Longest query (scheduled tokens) of any request this step; 1 for a decode-only batch.
    max_query_len: int
    # Longest sequence (computed + scheduled tokens) of any request this step.
    max_seq_len: int
    # (num_reqs + 1,) int32: where each request's tokens start in the flat batch.
    query_start_loc: torch.Tensor
    # (num_reqs,) int32: computed + scheduled tokens of each request after this step.
    seq_lens: torch.Tensor
    # (num_reqs, max_num_blocks_per_req) int32: physical block ids; 0 is the null block.
    block_table: torch.Tensor
    # (num_actual_tokens,) int64: cache slot (block * block_size + offset) of each token.
    slot_mapping: torch.Tensor
    # Host copies of the two request-level arrays, so a backend can plan without a sync.
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    # Attention is causal within a request's sequence; False for encoder self-attention.
    causal: bool = True

    @property
    def query_lens_np(self) -> np.ndarray:
        return np.diff(self.query_start_loc_np)


class AttentionBackend(ABC):
    """Writes a layer's new keys and values into the paged cache and attends over it."""

    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # (num_tokens, num_heads, head_size)
        key: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
        value: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
        kv_cache: KVCacheView,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_size)
        """Stores `key`/`value` at `metadata.slot_mapping`, then returns the attention output.

        Each query token attends to its request's cached keys up to and including its own
        position (queries of request `i` sit at positions `seq_lens[i] - query_len + j`).
        Grouped-query attention: query head `h` reads kv head `h // (num_heads // num_kv_heads)`.
        """
