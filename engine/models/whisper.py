"""Whisper: an audio encoder over log-mel features and a text decoder, pre-norm layers.

The encoder's front end is two 1-D convolutions over time (kernel 3; the second of
stride 2), each followed by exact GELU, so `2 * max_source_positions` feature frames
become `max_source_positions` positions; sinusoidal positions (stored in the checkpoint
as `model.encoder.embed_positions.weight`) are added, and a final layer norm closes
each stack. Every request's audio is padded to the same length by the feature
extractor, so every encoder input has exactly `max_source_positions` positions.
Key projections have no bias (the loader zero-fills that block of the fused ones). The
output projection `proj_out` is the decoder's token table unless the checkpoint unties
them; unlike BART, nothing is scaled (`scale_embedding` is not read by the reference).
"""

from __future__ import annotations

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

# The front end's second convolution halves the frames: positions = frames / 2.
FRAMES_PER_POSITION = 2


class Conv1d(nn.Module):
    """A 1-D convolution over (batch, channels, time) with weights the loader fills."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        *,
        kernel_size: int,
        stride: int,
        padding: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.stride = stride
        self.padding = padding
        self.weight = nn.Parameter(
            torch.empty(out_channels, in_channels, kernel_size, dtype=dtype), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_channels, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, in_channels, time) -> (batch, out_channels, time // stride)
        return F.conv1d(x, self.weight, self.bias, stride=self.stride, padding=self.padding)


class WhisperEncoder(nn.Module):
    """Conv front end, positions, encoder layers, final norm (`model.encoder.`)."""

    def __init__(
        self, config: ModelArchConfig, attn_backend: AttentionBackend, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        eps = config.rms_norm_eps
        self.num_mel_bins = config.num_mel_bins
        self.num_positions = config.max_encoder_positions
        self.conv1 = Conv1d(
            config.num_mel_bins, hidden, kernel_size=3, stride=1, padding=1, dtype=dtype
        )
        self.conv2 = Conv1d(
            hidden, hidden, kernel_size=3, stride=FRAMES_PER_POSITION, padding=1, dtype=dtype
        )
        self.embed_positions = VocabEmbedding(config.max_encoder_positions, hidden, dtype=dtype)
        num_heads = int(config.raw["encoder_attention_heads"])
        ffn_size = int(config.raw["encoder_ffn_dim"])
        self.layers = nn.ModuleList(
            EncoderLayer(
                hidden, num_heads, ffn_size, config.hidden_act, attn_backend,
                pre_norm=True, eps=eps, dtype=dtype,
            )
            for _ in range(config.num_encoder_layers)
        )
        self.layer_norm = LayerNorm(hidden, eps, dtype=dtype)

    def check_features(self, features: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Features are (num_reqs, num_mel_bins, 2 * max_source_positions), one row per
        request of `metadata`, whose requests own `max_source_positions` rows each."""
        expected = (metadata.num_reqs, self.num_mel_bins, FRAMES_PER_POSITION * self.num_positions)
        if tuple(features.shape) != expected:
            raise ValueError(
                f"Whisper input_features must be (num_reqs, num_mel_bins, frames) = {expected}, "
                f"got {tuple(features.shape)}"
            )
        if metadata.num_actual_tokens != metadata.num_reqs * self.num_positions:
            raise ValueError(
                f"Whisper's encoder metadata must hold {self.num_positions} positions per "
                f"request ({metadata.num_reqs} requests), got {metadata.num_actual_tokens}"
            )

    def forward(
        self,
        input_features: torch.Tensor,  # (num_reqs, num_mel_bins, 2 * num_positions)
        attn_metadata: AttentionMetadata,  # ENCODER
    ) -> torch.Tensor:
        self.check_features(input_features, attn_metadata)
        x = input_features.to(self.conv1.weight.dtype)
        x = F.gelu(self.conv1(x))  # (num_reqs, hidden_size, 2 * num_positions)
        x = F.gelu(self.conv2(x))  # (num_reqs, hidden_size, num_positions)
        x = x.transpose(1, 2) + self.embed_positions.weight  # (num_reqs, num_positions, hidden)
        hidden_states = x.reshape(-1, x.shape[-1])  # (num_reqs * num_positions, hidden_size)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attn_metadata)
        return self.layer_norm(hidden_states)


class WhisperDecoder(nn.Module):
    """Token table, learned positions, decoder layers, final norm (`model.decoder.`)."""

    def __init__(
        self, config: ModelArchConfig, attn_backend: AttentionBackend, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        eps = config.rms_norm_eps
        self.embed_tokens = VocabEmbedding(config.vocab_size, hidden, dtype=dtype)
        self.embed_positions = VocabEmbedding(config.max_position_embeddings, hidden, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(
                hidden, config.num_heads, config.intermediate_size, config.hidden_act,
                attn_backend, pre_norm=True, eps=eps, dtype=dtype,
            )
            for _ in range(config.num_layers)
        )
        self.layer_norm = LayerNorm(hidden, eps, dtype=dtype)

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # (num_tokens, hidden_size)
        positions: torch.Tensor,  # (num_tokens,) int64
        kv_caches: list[KVCacheView],
        attn_metadata: AttentionMetadata,  # DECODER, with `cross`
    ) -> torch.Tensor:
        hidden_states = inputs_embeds + self.embed_positions(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states = layer(hidden_states, kv_cache, attn_metadata)
        return self.layer_norm(hidden_states)  # (num_tokens, hidden_size)


class WhisperModel(nn.Module):
    """The encoder and the decoder (`model.`)."""

    def __init__(
        self, config: ModelArchConfig, attn_backend: AttentionBackend, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(config, attn_backend, dtype=dtype)
        self.decoder = WhisperDecoder(config, attn_backend, dtype=dtype)


class WhisperForConditionalGeneration(EncoderDecoderBase):
    """Whisper with its output head; the engine's model interface for an encoder-decoder.

    `encode` runs the encoder over log-mel features, `write_cross_kv` fills the cross
    blocks, and `forward` / `compute_logits` run the decoder like a decoder-only model.
    """

    # Key projections carry no bias; their block of the fused biases stays zero.
    zero_when_absent: tuple[str, ...] = ("k_proj.bias",)

    def __init__(
        self, config: ModelArchConfig, attn_backend: AttentionBackend, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.check_config(config, "audio")
        self.config = config
        self.model = WhisperModel(config, attn_backend, dtype=dtype)
        if not config.tie_word_embeddings:
            self.proj_out = Linear(config.hidden_size, [config.vocab_size], bias=False, dtype=dtype)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: (num_tokens,) int64 -> (num_tokens, hidden_size)."""
        return self.model.decoder.embed_tokens(input_ids)

    def encode(self, batch: EncoderBatch) -> torch.Tensor:
        """The encoder's final hidden states (num_reqs * max_source_positions, hidden_size)
        of `batch.input_features` (num_reqs, num_mel_bins, 2 * max_source_positions)."""
        if batch.input_features is None:
            raise ValueError("Whisper's encoder reads audio: the batch needs input_features")
        return self.model.encoder(batch.input_features, batch.metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: (n, hidden_size) -> float32 logits (n, vocab_size)."""
        if self.config.tie_word_embeddings:
            return F.linear(hidden_states, self.model.decoder.embed_tokens.weight).float()
        return self.proj_out(hidden_states).float()
