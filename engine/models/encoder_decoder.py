"""What the engine hands an encoder-decoder model (BART, Whisper), and what it calls on it.

A step of an encoder-decoder model has up to two passes (seed 004):
1. The encoder, for requests admitted this step whose cross-attention blocks are not
   cached: `encode` runs their encoder inputs as one flat batch (non-causal attention,
   nothing cached), then `write_cross_kv` projects the encoder output through every
   decoder layer's cross-attention key and value projections and stores them at the
   requests' cross-attention slots. Those blocks are read-only afterwards.
2. The decoder, for every scheduled token, exactly like a decoder-only model (`forward`,
   `compute_logits`): self-attention is causal and paged; cross-attention reads the cross
   blocks through `attn_metadata.cross`.

Cross blocks have the same layout as self-attention blocks (one per decoder layer's keys
and values for `block_size` positions), so they come from the same pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from kvferry.engine.attention.backend import AttentionMetadata, KVCacheView


@dataclass
class EncoderBatch:
    """One step's encoder inputs, flat like the decoder's batch."""

    # ENCODER-type attention over the encoder positions: request `i` owns rows
    # `query_start_loc[i]:query_start_loc[i + 1]` of the encoder output.
    metadata: AttentionMetadata
    # Token encoders (BART): (num_positions,) int64 ids and the position of each in its
    # request's input (0-based).
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    # Audio encoders (Whisper): (num_reqs, num_mel_bins, 2 * max_encoder_positions)
    # log-mel features; the encoder output has max_encoder_positions rows per request.
    input_features: torch.Tensor | None = None


@runtime_checkable
class EncoderDecoderModel(Protocol):
    """The calls the runner makes on an encoder-decoder model, beside the decoder-only ones
    (`forward`, `compute_logits`, `get_input_embeddings`)."""

    is_encoder_decoder: bool

    def encode(self, batch: EncoderBatch) -> torch.Tensor:
        """The encoder's final hidden states, (num_positions, hidden_size)."""
        ...

    def write_cross_kv(
        self,
        encoder_hidden: torch.Tensor,  # (num_positions, hidden_size)
        kv_caches: list[KVCacheView],  # one per decoder layer
        slot_mapping: torch.Tensor,  # (num_positions,) int64: each position's cross slot
    ) -> None:
        """Stores every decoder layer's cross-attention keys and values of the encoder
        output at `slot_mapping` (through the attention backend's `write_kv`)."""
        ...
