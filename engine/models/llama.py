"""Llama-family decoders: Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

The three share one pre-norm decoder layer; a subclass only says which biases and norms
its attention carries. Every forward runs one flat batch of all requests' tokens (no
batch axis, no padding); attention goes through the paged backend with explicit
metadata. Projections that read the same input are fused (q/k/v into `qkv_proj`,
gate/up into `gate_up_proj`); the loader stacks the checkpoint's tensors into them.

Pipeline parallelism: a model built for one `PipelineStage` holds only that stage's layers
(as local layers 0..n-1; `checkpoint_name` maps them back to the checkpoint's numbering),
the embedding on the first stage, the final norm and the head on the last (and the
embedding there too when the head is tied to it). A stage after the first takes the
previous stage's `(hidden_states, residual)` instead of token ids; a stage before the last
returns them instead of normed hidden states.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from kvferry.engine.attention.backend import AttentionBackend, AttentionMetadata, KVCacheView
from kvferry.engine.attention.triton.activation import silu_and_mul as triton_silu_and_mul
from kvferry.engine.attention.triton.rotary import rotary_embedding
from kvferry.engine.executor.partition import PipelineStage
from kvferry.engine.layers.activation import silu_and_mul
from kvferry.engine.layers.embedding import VocabEmbedding
from kvferry.engine.layers.linear import Linear
from kvferry.engine.layers.rmsnorm import RMSNorm
from kvferry.engine.layers.rotary import RotaryEmbedding, apply_rotary_emb
from kvferry.engine.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    shard_heads,
)
from kvferry.engine.models.config import ModelArchConfig
from torch import nn

# What a stage before the last hands the next one: the last layer's output is their sum.
# Both (num_tokens, hidden_size).
IntermediateTensors = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, optional q/k norm, rope, paged attention, output projection."""

    triton_kernels = False  # rope by the Triton kernel (see kvferry.engine.layers.kernels)

    def __init__(
        self,
        config: ModelArchConfig,
        attn_backend: AttentionBackend,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        dtype: torch.dtype,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        # The heads this rank holds (all of them without tensor parallelism).
        heads = shard_heads(config.num_heads, config.num_kv_heads, tp)
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_size = head_size = config.head_size
        self.q_size = heads.num_heads * head_size
        self.kv_size = heads.num_kv_heads * head_size
        self.scale = head_size**-0.5
        self.attn_backend = attn_backend
        self.qkv_proj: Linear
        self.o_proj: Linear
        if tp.size == 1:
            self.qkv_proj = Linear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                   bias=qkv_bias, dtype=dtype)
            self.o_proj = Linear(self.q_size, [config.hidden_size], bias=o_bias, dtype=dtype)
        else:
            q_rows = (heads.first_head * head_size, self.q_size)
            kv_rows = (heads.first_kv_head * head_size, self.kv_size)
            self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q_rows, kv_rows, kv_rows],
                                                 bias=qkv_bias, dtype=dtype)
            self.o_proj = RowParallelLinear(q_rows, config.hidden_size, tp, bias=o_bias,
                                            dtype=dtype)
        self.q_norm = (
            RMSNorm(config.head_size, config.rms_norm_eps, dtype=dtype) if qk_norm else None
        )
        self.k_norm = (
            RMSNorm(config.head_size, config.rms_norm_eps, dtype=dtype) if qk_norm else None
        )

    def forward(
        self,
        hidden_states: torch.Tensor,  # (num_tokens, hidden_size)
        cos: torch.Tensor,  # (num_tokens, head_size // 2)
        sin: torch.Tensor,  # (num_tokens, head_size // 2)
        kv_cache: KVCacheView,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # (num_tokens, q_size + 2 * kv_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.triton_kernels:
            # cos/sin already hold each token's row: token t reads row t. In place, on
            # views of the projection's output.
            rows = torch.arange(num_tokens, device=q.device)
            rotary_embedding(rows, q, k, cos, sin, is_neox=True, round_each_op=True)
        else:
            q = apply_rotary_emb(q, cos, sin)  # (num_tokens, num_heads, head_size)
            k = apply_rotary_emb(k, cos, sin)  # (num_tokens, num_kv_heads, head_size)
        out = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))  # (num_tokens, hidden_size)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))` with gate and up fused."""

    triton_kernels = False  # SiLU-and-mul by the Triton kernel

    def __init__(self, config: ModelArchConfig, *, dtype: torch.dtype,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        size = config.intermediate_size
        self.gate_up_proj: Linear
        self.down_proj: Linear
        if tp.size == 1:
            self.gate_up_proj = Linear(config.hidden_size, [size, size], bias=config.mlp_bias,
                                       dtype=dtype)
            self.down_proj = Linear(size, [config.hidden_size], bias=config.mlp_bias,
                                    dtype=dtype)
            return
        if size % tp.size:
            raise ValueError(f"intermediate_size {size} does not split over tensor-parallel "
                             f"size {tp.size}")
        columns = (tp.rank * size // tp.size, size // tp.size)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [columns, columns],
                                                 bias=config.mlp_bias, dtype=dtype)
        self.down_proj = RowParallelLinear(columns, config.hidden_size, tp,
                                           bias=config.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size) -> (num_tokens, hidden_size)
        act = triton_silu_and_mul if self.triton_kernels else silu_and_mul
        return self.down_proj(act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the next norm (see `RMSNorm`)."""

    def __init__(
        self, config: ModelArchConfig, self_attn: LlamaAttention, *, dtype: torch.dtype,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = LlamaMLP(config, dtype=dtype, tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype
        )

    def forward(
        self,
        hidden_states: torch.Tensor,  # (num_tokens, hidden_size)
        residual: torch.Tensor | None,  # (num_tokens, hidden_size); None before layer 0
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCacheView,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(mlp_out, residual)`; their sum is this layer's output."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.add_and_norm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos, sin, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm.add_and_norm(
            hidden_states, residual
        )
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embeddings, the decoder layers and the final norm (HF's `model.` prefix), or the
    part of them one pipeline stage holds."""

    def __init__(
        self,
        config: ModelArchConfig,
        attn_backend: AttentionBackend,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        dtype: torch.dtype,
        stage: PipelineStage,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.stage = stage
        # The last stage of a tied model reads the table as its output projection.
        needs_embedding = stage.is_first or (stage.is_last and config.tie_word_embeddings)
        self.embed_tokens: nn.Module | None = None
        if needs_embedding:
            self.embed_tokens = (
                VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype)
                if tp.size == 1
                else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
            )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config,
                LlamaAttention(
                    config,
                    attn_backend,
                    qkv_bias=qkv_bias,
                    o_bias=o_bias,
                    qk_norm=qk_norm,
                    dtype=dtype,
                    tp=tp,
                ),
                dtype=dtype,
                tp=tp,
            )
            for _ in range(stage.num_layers)
        )
        self.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype) if stage.is_last
            else None
        )
        self.rotary_emb = RotaryEmbedding(
            config.head_size,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dtype=dtype,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,  # (num_tokens, hidden_size)
        positions: torch.Tensor,  # (num_tokens,) int64
        kv_caches: list[KVCacheView],
        attn_metadata: AttentionMetadata,
        residual: torch.Tensor | None = None,  # (num_tokens, hidden_size); None on stage 0
    ) -> torch.Tensor | IntermediateTensors:
        """The last stage returns normed hidden states (num_tokens, hidden_size); an
        earlier one `(hidden_states, residual)` for the next stage."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"got {len(kv_caches)} KV cache views for a model of {len(self.layers)} layers"
            )
        cos, sin = self.rotary_emb(positions)  # (num_tokens, head_size // 2) each
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(
                hidden_states, residual, cos, sin, kv_cache, attn_metadata
            )
        if self.norm is None:
            assert residual is not None  # every stage has a layer
            return hidden_states, residual
        hidden_states, _ = self.norm.add_and_norm(hidden_states, residual)
        return hidden_states  # (num_tokens, hidden_size)


_LAYERS_PREFIX = "model.layers."


class LlamaForCausalLM(nn.Module):
    """A Llama decoder with its output head; the engine's model interface.

    Attention biases follow `config.attention_bias` (q/k/v and o together).
    """

    # Can be split into pipeline stages (`stage`) and tensor-parallel shards (`tp`).
    supports_pipeline_parallel: ClassVar[bool] = True
    supports_tensor_parallel: ClassVar[bool] = True

    # Which checkpoint projections each fused module holds, in row order.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    # Per-head RMSNorm on q and k before rope (Qwen3).
    use_qk_norm: ClassVar[bool] = False

    def __init__(
        self, config: ModelArchConfig, attn_backend: AttentionBackend, dtype: torch.dtype,
        stage: PipelineStage | None = None, tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"{config.architecture}: hidden_act {config.hidden_act!r} is not supported; "
                "supported: silu"
            )
        self.config = config
        self.stage = PipelineStage.whole(config.num_layers) if stage is None else stage
        # Tensor parallelism: this rank's heads, MLP columns and vocabulary rows.
        self.tp = tp or TensorParallel()
        if self.stage.end_layer > config.num_layers:
            raise ValueError(f"pipeline stage {self.stage.index} runs layers up to "
                             f"{self.stage.end_layer}; the model has {config.num_layers}")
        qkv_bias, o_bias = self.attention_biases(config)
        self.model = LlamaModel(
            config,
            attn_backend,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=self.use_qk_norm,
            dtype=dtype,
            stage=self.stage,
            tp=self.tp,
        )
        # Tied checkpoints reuse the embedding table as the output projection.
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings and self.stage.is_last:
            self.lm_head = (
                Linear(config.hidden_size, [config.vocab_size], bias=False, dtype=dtype)
                if self.tp.size == 1
                else VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.tp,
                                            dtype)
            )

    @classmethod
    def attention_biases(cls, config: ModelArchConfig) -> tuple[bool, bool]:
        """Returns `(qkv_bias, o_bias)` for this architecture."""
        return config.attention_bias, config.attention_bias

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of parameter `name`: a stage's local layer i is the
        checkpoint's layer `start_layer + i`."""
        start = self.stage.start_layer
        if not start or not name.startswith(_LAYERS_PREFIX):
            return name
        index, rest = name[len(_LAYERS_PREFIX):].split(".", 1)
        return f"{_LAYERS_PREFIX}{int(index) + start}.{rest}"

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: (num_tokens,) int64 -> (num_tokens, hidden_size)."""
        if self.model.embed_tokens is None or not self.stage.is_first:
            raise ValueError(f"pipeline stage {self.stage.index} does not embed tokens; "
                             "stage 0 does")
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,  # (num_tokens,) int64
        positions: torch.Tensor,  # (num_tokens,) int64
        kv_caches: list[KVCacheView],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # (num_tokens, hidden_size)
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Runs one flat batch; returns hidden states (num_tokens, hidden_size), or on a
        pipeline stage before the last `(hidden_states, residual)` for the next stage.

        On the first stage exactly one of `input_ids` and `inputs_embeds` gives the
        inputs; a later stage reads `intermediate`, the previous stage's output. Local
        layer `i` reads and writes `kv_caches[i]` at `attn_metadata.slot_mapping`.
        """
        if not self.stage.is_first:
            if intermediate is None:
                raise ValueError(f"pipeline stage {self.stage.index} needs the previous "
                                 "stage's (hidden_states, residual)")
            hidden_states, residual = intermediate
            return self.model(hidden_states, positions, kv_caches, attn_metadata, residual)
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("forward needs input_ids or inputs_embeds; both are None")
            inputs_embeds = self.get_input_embeddings(input_ids)
        return self.model(inputs_embeds, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: (n, hidden_size) -> float32 logits (n, vocab_size)."""
        if not self.stage.is_last:
            raise ValueError(f"pipeline stage {self.stage.index} has no output head; the "
                             "last stage computes logits")
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        assert head is not None  # tied: the last stage holds the embedding
        if isinstance(head, VocabParallelEmbedding):
            return head.logits(hidden_states)  # each rank's vocabulary rows, gathered
        if self.lm_head is None:
            return F.linear(hidden_states, head.weight).float()
        return self.lm_head(hidden_states).float()


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: a Llama with bias on q/k/v (never on o)."""

    def __init__(
        self, config: ModelArchConfig, attn_backend: AttentionBackend, dtype: torch.dtype,
        stage: PipelineStage | None = None, tp: TensorParallel | None = None,
    ) -> None:
        if config.raw.get("use_sliding_window"):
            raise ValueError(
                f"{config.architecture}: use_sliding_window=true is not supported; "
                "only full attention is"
            )
        super().__init__(config, attn_backend, dtype, stage, tp)

    @classmethod
    def attention_biases(cls, config: ModelArchConfig) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Qwen3: RMSNorm over each q and k head before rope; biases as `attention_bias`."""

    use_qk_norm: ClassVar[bool] = True

    @classmethod
    def attention_biases(cls, config: ModelArchConfig) -> tuple[bool, bool]:
        return config.attention_bias, config.attention_bias
