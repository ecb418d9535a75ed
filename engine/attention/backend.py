"""The interface every attention backend implements, and the metadata it reads.

All requests of a step run as one flat token batch with no padding between them
(seed 003): request `i` owns the query rows `query_start_loc[i]:query_start_loc[i+1]`,
and its keys are the first `seq_lens[i]` slots addressed by row `i` of `block_table`.
The newest `query_len` of those keys are the ones this step writes, at `slot_mapping`.

Three kinds of attention share that shape (`AttentionType`, seed 004):
- DECODER: causal self-attention over the paged cache; the step's keys and values are
  written at `slot_mapping` first.
- ENCODER: non-causal self-attention of an encoder over the step's own keys and values
  (request `i`'s keys are rows `query_start_loc[i]:query_start_loc[i+1]`); nothing is
  cached, `kv_cache` may be None.
- CROSS: a decoder's queries over the encoder's keys, non-causal, read from the request's
  cross-attention blocks (`block_table` is the cross block table and `seq_lens` the
  encoder lengths); nothing is written (the encoder step wrote them with `write_kv`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import enum
from dataclasses import dataclass

import numpy as np
import torch

# One layer's paged cache: (key_cache, value_cache), each
# (num_blocks, block_size, num_kv_heads, head_size). Both are strided views of the
# engine's single cache tensor [num_blocks, num_layers, 2, block_size, num_kv_heads,
# head_size], so they are not contiguous: index them by (block, offset), never flatten.
KVCacheView = tuple[torch.Tensor, torch.Tensor]


class AttentionType(enum.Enum):
    DECODER = "decoder"
    ENCODER = "encoder"
    CROSS = "cross"


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
    # Attention is causal within a request's sequence (DECODER type only; ENCODER and
    # CROSS attention are never causal).
    causal: bool = True
    attn_type: AttentionType = AttentionType.DECODER
    # Encoder-decoder models: the same step's cross-attention (type CROSS: the rows' cross
    # block tables and encoder lengths, the same query_start_loc); None otherwise.
    cross: AttentionMetadata | None = None

    @property
    def is_causal(self) -> bool:
        return self.causal and self.attn_type is AttentionType.DECODER

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

        For ENCODER attention nothing is stored and `key`/`value` are the keys; for CROSS
        attention `key`/`value` are None and the keys are read from the cache (see the
        module docstring). Under DECODER attention each query token attends to its
        request's cached keys up to and including its own position (queries of request `i`
        sit at positions `seq_lens[i] - query_len + j`).
        Grouped-query attention: query head `h` reads kv head `h // (num_heads // num_kv_heads)`.
        """

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
        value: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
        kv_cache: KVCacheView,
        slot_mapping: torch.Tensor,  # (num_tokens,) int64; a negative slot writes nothing
    ) -> None:
        """Stores keys and values at their slots without attending (an encoder step writes
        each decoder layer's cross-attention keys this way)."""
