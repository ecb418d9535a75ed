"""BART: a token encoder and a decoder with cross-attention, post-norm layers.

Embeddings: token embeddings (times sqrt(d_model) when `scale_embedding`) plus learned
positions whose table starts two rows late (position `p` reads row `p + 2`, a leftover of
fairseq's padding offset), then `layernorm_embedding`. The logits add
`final_logits_bias`. With `tie_word_embeddings` (the default) one table, `model.shared`,
embeds the encoder's and the decoder's tokens and is the output projection; otherwise
`model.encoder.embed_tokens`, `model.decoder.embed_tokens` and `lm_head` are separate.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from kvferry.engine.attention.backend import AttentionBackend, AttentionMetadata, KVCacheView
from kvferry.engine.layers.embedding import VocabEmbedding
from kvferry.engine.layers.layernorm import LayerNorm
from kvferry.engine.layers.linear import Linear
from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.models.encoder_decoder import EncoderBatch
from kvferry.engine.models.seq2seq_layers import DecoderLayer, EncoderDecoderBase, EncoderLayer
from torch import nn

# Learned position `p` is row `p + POSITION_OFFSET` of `embed_positions`.
POSITION_OFFSET = 2


class BartEncoder(nn.Module):
    """Learned positions, the embedding layer norm and the encoder layers (`model.encoder.`)."""

    def __init__(
        self, config: ModelArchConfig, attn_backend: AttentionBackend, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        eps = config.rms_norm_eps
        if not config.tie_word_embeddings:
            self.embed_tokens = VocabEmbedding(config.vocab_size, hidden, dtype=dtype)
        self.embed_positions = VocabEmbedding(
            config.max_encoder_positions + POSITION_OFFSET, hidden, dtype=dtype
        )
        self.layernorm_embedding = LayerNorm(hidden, eps, dtype=dtype)
        num_heads = int(config.raw["encoder_attention_heads"])
        ffn_size = int(config.raw["encoder_ffn_dim"])
        self.layers = nn.ModuleList(
            EncoderLayer(
                hidden, num_heads, ffn_size, config.hidden_act, attn_backend,
                pre_norm=False, eps=eps, dtype=dtype,
            )
            for _ in range(config.num_encoder_layers)
        )

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # (num_positions, hidden_size), scaled token embeddings
        positions: torch.Tensor,  # (num_positions,) int64
        attn_metadata: AttentionMetadata,  # ENCODER
    ) -> torch.Tensor:
        hidden_states = inputs_embeds + self.embed_positions(positions + POSITION_OFFSET)
        hidden_states = self.layernorm_embedding(hidden_states)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attn_metadata)
        return hidden_states  # (num_positions, hidden_size)


class BartDecoder(nn.Module):
    """Learned positions, the embedding layer norm and the decoder layers (`model.decoder.`)."""

    def __init__(
        self, config: ModelArchConfig, attn_backend: AttentionBackend, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        eps = config.rms_norm_eps
        if not config.tie_word_embeddings:
            self.embed_tokens = VocabEmbedding(config.vocab_size, hidden, dtype=dtype)
        self.embed_positions = VocabEmbedding(
            config.max_position_embeddings + POSITION_OFFSET, hidden, dtype=dtype
        )
        self.layernorm_embedding = LayerNorm(hidden, eps, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(
                hidden, config.num_heads, config.intermediate_size, config.hidden_act,
                attn_backend, pre_norm=False, eps=eps, dtype=dtype,
            )
            for _ in range(config.num_layers)
        )

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # (num_tokens, hidden_size), scaled token embeddings
        positions: torch.Tensor,  # (num_tokens,) int64
        kv_caches: list[KVCacheView],
        attn_metadata: AttentionMetadata,  # DECODER, with `cross`
    ) -> torch.Tensor:
        hidden_states = inputs_embeds + self.embed_positions(positions + POSITION_OFFSET)
        hidden_states = self.layernorm_embedding(hidden_states)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states = layer(hidden_states, kv_cache, attn_metadata)
        return hidden_states  # (num_tokens, hidden_size)


class BartModel(nn.Module):
    """The shared token table (tied checkpoints), the encoder and the decoder (`model.`)."""

    def __init__(
        self, config: ModelArchConfig, attn_backend: AttentionBackend, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        if config.tie_word_embeddings:
            self.shared = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.encoder = BartEncoder(config, attn_backend, dtype=dtype)
        self.decoder = BartDecoder(config, attn_backend, dtype=dtype)


class BartForConditionalGeneration(EncoderDecoderBase):
    """BART with its output head; the engine's model interface for an encoder-decoder.

    `encode` runs the encoder over token ids, `write_cross_kv` fills the cross blocks,
    and `forward` / `compute_logits` run the decoder like a decoder-only model.
    """

    def __init__(
        self, config: ModelArchConfig, attn_backend: AttentionBackend, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.check_config(config, "tokens")
        self.config = config
        # The reference multiplies token embeddings (never positions) by this.
        scaled = bool(config.raw.get("scale_embedding"))
        self.embed_scale = math.sqrt(config.hidden_size) if scaled else 1.0
        self.model = BartModel(config, attn_backend, dtype=dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, [config.vocab_size], bias=False, dtype=dtype)
        # (1, vocab_size), as stored.
        self.final_logits_bias = nn.Parameter(
            torch.empty(1, config.vocab_size, dtype=dtype), requires_grad=False
        )

    def _token_table(self, side: nn.Module) -> VocabEmbedding:
        if self.config.tie_word_embeddings:
            return self.model.shared
        return side.embed_tokens

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Decoder token embeddings, scaled as the decoder reads them (what HF's
        `get_input_embeddings()` returns): (num_tokens,) int64 -> (num_tokens, hidden_size)."""
        return self._token_table(self.model.decoder)(input_ids) * self.embed_scale

    def encode(self, batch: EncoderBatch) -> torch.Tensor:
        """The encoder's final hidden states (num_positions, hidden_size) of
        `batch.input_ids` at `batch.positions` (each request's from 0)."""
        if batch.input_ids is None or batch.positions is None:
            raise ValueError(
                "BART's encoder reads token ids: the batch needs input_ids and positions"
            )
        if batch.input_ids.shape != batch.positions.shape or batch.input_ids.dim() != 1:
            raise ValueError(
                f"encoder input_ids {tuple(batch.input_ids.shape)} and positions "
                f"{tuple(batch.positions.shape)} must be one flat batch of the same length"
            )
        embeds = self._token_table(self.model.encoder)(batch.input_ids) * self.embed_scale
        return self.model.encoder(embeds, batch.positions, batch.metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: (n, hidden_size) -> float32 logits (n, vocab_size)."""
        if self.config.tie_word_embeddings:
            logits = F.linear(hidden_states, self.model.shared.weight)
        else:
            logits = self.lm_head(hidden_states)
        return (logits + self.final_logits_bias).float()
