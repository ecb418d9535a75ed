"""The transformer layers BART and Whisper share: attention, encoder and decoder layers.

Both follow the original encoder-decoder transformer (seed 004): an encoder layer is
self-attention and a feed-forward block; a decoder layer adds cross-attention over the
encoder output between the two. BART normalizes after each residual add (post-norm),
Whisper before each block (pre-norm); the layers take that as a flag. Names follow the
HF checkpoints (`self_attn`, `encoder_attn`, `fc1`, `fc2`, `*_layer_norm`), with the
projections that read the same input fused: q/k/v of self-attention into `qkv_proj`, k/v
of cross-attention into `kv_proj`.

Every call runs one flat batch (no batch axis, no padding), and attention goes through
the backend with explicit metadata: ENCODER metadata in the encoder, the step's DECODER
metadata for decoder self-attention, and its `cross` (CROSS) metadata for cross-attention,
whose keys and values `CrossAttention.write_kv` stored in the cross blocks beforehand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from kvferry.engine.attention.backend import AttentionBackend, AttentionMetadata, KVCacheView
from kvferry.engine.layers.activation import gelu_activation
from kvferry.engine.layers.layernorm import LayerNorm
from kvferry.engine.layers.linear import Linear
from kvferry.engine.models.config import ModelArchConfig
from torch import nn

# Which checkpoint projections each fused module holds, in row order (see the loader).
PACKED_MODULES_MAPPING: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "kv_proj": ("k_proj", "v_proj"),
}


def _residual(
    hidden_states: torch.Tensor,  # (num_tokens, hidden_size)
    norm: LayerNorm,
    block: Callable[[torch.Tensor], torch.Tensor],
    pre_norm: bool,
) -> torch.Tensor:
    """One residual block: `x + block(norm(x))` (pre-norm) or `norm(x + block(x))`."""
    if pre_norm:
        return hidden_states + block(norm(hidden_states))
    return norm(hidden_states + block(hidden_states))


class _HeadsAttention(nn.Module):
    """What both attentions share: the head split, the softmax scale and the backend."""

    def __init__(self, hidden_size: int, num_heads: int, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = hidden_size // num_heads
        self.hidden_size = hidden_size
        self.scale = self.head_size**-0.5
        self.attn_backend = attn_backend


class SelfAttention(_HeadsAttention):
    """Fused q/k/v projection, backend attention, output projection, all with bias (Whisper
    has none on keys: that block stays zero).

    Encoder layers run it with ENCODER metadata and no cache; decoder layers with the
    step's DECODER metadata, which writes the new keys and values into their cache.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        attn_backend: AttentionBackend,
        *,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(hidden_size, num_heads, attn_backend)
        size = hidden_size
        self.qkv_proj = Linear(hidden_size, [size, size, size], bias=True, dtype=dtype)
        self.out_proj = Linear(size, [hidden_size], bias=True, dtype=dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,  # (num_tokens, hidden_size)
        kv_cache: KVCacheView | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        heads = (num_tokens, self.num_heads, self.head_size)
        q, k, v = self.qkv_proj(hidden_states).split(self.hidden_size, dim=-1)
        out = self.attn_backend.forward(
            q.view(heads), k.view(heads), v.view(heads), kv_cache, attn_metadata, self.scale
        )  # (num_tokens, num_heads, head_size)
        return self.out_proj(out.reshape(num_tokens, self.hidden_size))


class CrossAttention(_HeadsAttention):
    """A decoder's queries over the encoder output's keys and values, read from the
    request's cross blocks; `write_kv` projects the encoder output and stores them there."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        attn_backend: AttentionBackend,
        *,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(hidden_size, num_heads, attn_backend)
        size = hidden_size
        self.q_proj = Linear(hidden_size, [size], bias=True, dtype=dtype)
        self.kv_proj = Linear(hidden_size, [size, size], bias=True, dtype=dtype)
        self.out_proj = Linear(size, [hidden_size], bias=True, dtype=dtype)

    def write_kv(
        self,
        encoder_hidden: torch.Tensor,  # (num_positions, hidden_size)
        kv_cache: KVCacheView,
        slot_mapping: torch.Tensor,  # (num_positions,) int64
    ) -> None:
        heads = (encoder_hidden.shape[0], self.num_heads, self.head_size)
        k, v = self.kv_proj(encoder_hidden).split(self.hidden_size, dim=-1)
        self.attn_backend.write_kv(k.view(heads), v.view(heads), kv_cache, slot_mapping)

    def forward(
        self,
        hidden_states: torch.Tensor,  # (num_tokens, hidden_size)
        kv_cache: KVCacheView,
        cross_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q = self.q_proj(hidden_states).view(num_tokens, self.num_heads, self.head_size)
        out = self.attn_backend.forward(q, None, None, kv_cache, cross_metadata, self.scale)
        return self.out_proj(out.reshape(num_tokens, self.hidden_size))


class _Layer(nn.Module):
    """What both layers hold: self-attention and the feed-forward block `fc2(act(fc1(x)))`,
    each with its layer norm."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        ffn_size: int,
        activation: str,
        attn_backend: AttentionBackend,
        *,
        pre_norm: bool,
        eps: float,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.self_attn = SelfAttention(hidden_size, num_heads, attn_backend, dtype=dtype)
        self.self_attn_layer_norm = LayerNorm(hidden_size, eps, dtype=dtype)
        self.activation = gelu_activation(activation)
        self.fc1 = Linear(hidden_size, [ffn_size], bias=True, dtype=dtype)
        self.fc2 = Linear(ffn_size, [hidden_size], bias=True, dtype=dtype)
        self.final_layer_norm = LayerNorm(hidden_size, eps, dtype=dtype)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size) -> (num_tokens, hidden_size)
        return self.fc2(self.activation(self.fc1(x)))


class EncoderLayer(_Layer):
    """Self-attention over the request's own positions, then the feed-forward block."""

    def forward(
        self,
        hidden_states: torch.Tensor,  # (num_positions, hidden_size)
        attn_metadata: AttentionMetadata,  # ENCODER
    ) -> torch.Tensor:
        def attend(x: torch.Tensor) -> torch.Tensor:
            return self.self_attn(x, None, attn_metadata)

        hidden_states = _residual(hidden_states, self.self_attn_layer_norm, attend, self.pre_norm)
        hidden_states = _residual(
            hidden_states, self.final_layer_norm, self.feed_forward, self.pre_norm
        )
        if hidden_states.dtype == torch.float16:
            # As the reference does: keep float16 activations finite between layers.
            limit = torch.finfo(torch.float16).max - 1000
            hidden_states = hidden_states.clamp(min=-limit, max=limit)
        return hidden_states


class DecoderLayer(_Layer):
    """Causal self-attention, cross-attention over the encoder output, feed-forward.

    Layer `i`'s `kv_cache` holds both its self-attention keys (addressed by the step's
    block table) and its cross-attention keys (addressed by the cross block table).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        ffn_size: int,
        activation: str,
        attn_backend: AttentionBackend,
        *,
        pre_norm: bool,
        eps: float,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(
            hidden_size,
            num_heads,
            ffn_size,
            activation,
            attn_backend,
            pre_norm=pre_norm,
            eps=eps,
            dtype=dtype,
        )
        self.encoder_attn = CrossAttention(hidden_size, num_heads, attn_backend, dtype=dtype)
        self.encoder_attn_layer_norm = LayerNorm(hidden_size, eps, dtype=dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,  # (num_tokens, hidden_size)
        kv_cache: KVCacheView,
        attn_metadata: AttentionMetadata,  # DECODER, with `cross` set
    ) -> torch.Tensor:
        cross_metadata = attn_metadata.cross
        assert cross_metadata is not None  # checked once per step by the model's forward

        def attend_self(x: torch.Tensor) -> torch.Tensor:
            return self.self_attn(x, kv_cache, attn_metadata)

        def attend_encoder(x: torch.Tensor) -> torch.Tensor:
            return self.encoder_attn(x, kv_cache, cross_metadata)

        pre_norm = self.pre_norm
        hidden_states = _residual(hidden_states, self.self_attn_layer_norm, attend_self, pre_norm)
        hidden_states = _residual(
            hidden_states, self.encoder_attn_layer_norm, attend_encoder, pre_norm
        )
        return _residual(hidden_states, self.final_layer_norm, self.feed_forward, pre_norm)


class EncoderDecoderBase(nn.Module):
    """What BART and Whisper share above their layers: `write_cross_kv` and the decoder's
    `forward`. A subclass holds `self.model.decoder` (whose `layers` are DecoderLayers and
    whose forward takes `(inputs_embeds, positions, kv_caches, attn_metadata)`) and
    defines `get_input_embeddings`, `encode` and `compute_logits`."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = PACKED_MODULES_MAPPING
    is_encoder_decoder: bool = True
    model: nn.Module

    @staticmethod
    def check_config(config: ModelArchConfig, encoder_input: str) -> None:
        """ValueError naming the architecture when `config` is not an encoder-decoder one
        with this encoder input, or names an activation the layers lack."""
        if not config.is_encoder_decoder or config.encoder_input != encoder_input:
            raise ValueError(
                f"{config.architecture} needs an encoder-decoder config whose encoder reads "
                f"{encoder_input}, got is_encoder_decoder={config.is_encoder_decoder}, "
                f"encoder_input={config.encoder_input!r}"
            )
        try:
            gelu_activation(config.hidden_act)
        except ValueError as exc:
            raise ValueError(f"{config.architecture}: {exc}") from None

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def write_cross_kv(
        self,
        encoder_hidden: torch.Tensor,  # (num_positions, hidden_size)
        kv_caches: list[KVCacheView],  # one per decoder layer
        slot_mapping: torch.Tensor,  # (num_positions,) int64: each position's cross slot
    ) -> None:
        """Stores every decoder layer's cross-attention keys and values of the encoder
        output at `slot_mapping` (through the attention backend's `write_kv`)."""
        layers = self.model.decoder.layers
        _check_num_caches(kv_caches, len(layers))
        if slot_mapping.shape != encoder_hidden.shape[:1]:
            raise ValueError(
                f"write_cross_kv got {encoder_hidden.shape[0]} encoder positions but "
                f"{tuple(slot_mapping.shape)} slots; it needs one slot per position"
            )
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            layer.encoder_attn.write_kv(encoder_hidden, kv_cache, slot_mapping)

    def forward(
        self,
        input_ids: torch.Tensor | None,  # (num_tokens,) int64
        positions: torch.Tensor,  # (num_tokens,) int64: decoder positions, from 0
        kv_caches: list[KVCacheView],  # one per decoder layer
        attn_metadata: AttentionMetadata,  # DECODER, with `cross` (CROSS)
        inputs_embeds: torch.Tensor | None = None,  # (num_tokens, hidden_size)
    ) -> torch.Tensor:
        """Runs the decoder over one flat batch; returns hidden states (num_tokens, hidden_size).

        Exactly one of `input_ids` and `inputs_embeds` (as `get_input_embeddings` returns
        them) gives the inputs. Layer `i` writes and reads its self-attention keys in
        `kv_caches[i]` through `attn_metadata`, and reads its cross-attention keys there
        through `attn_metadata.cross` (written before by `write_cross_kv`).
        """
        _check_num_caches(kv_caches, len(self.model.decoder.layers))
        if attn_metadata.cross is None:
            raise ValueError(
                f"{type(self).__name__}.forward needs the step's cross-attention metadata "
                "(attn_metadata.cross); it is None"
            )
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("forward needs input_ids or inputs_embeds; both are None")
            inputs_embeds = self.get_input_embeddings(input_ids)
        return self.model.decoder(inputs_embeds, positions, kv_caches, attn_metadata)


def _check_num_caches(kv_caches: list[KVCacheView], num_layers: int) -> None:
    if len(kv_caches) != num_layers:
        raise ValueError(
            f"got {len(kv_caches)} KV cache views for a decoder of {num_layers} layers"
        )
