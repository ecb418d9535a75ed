"""Building blocks shared by the model definitions: norms, rotary embeddings, projections."""

from kvferry.engine.layers.activation import gelu_activation, silu_and_mul
from kvferry.engine.layers.embedding import VocabEmbedding
from kvferry.engine.layers.layernorm import LayerNorm
from kvferry.engine.layers.linear import Linear
from kvferry.engine.layers.rmsnorm import RMSNorm
from kvferry.engine.layers.rotary import RotaryEmbedding, apply_rotary_emb, compute_inv_freq

__all__ = [
    "LayerNorm",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "VocabEmbedding",
    "apply_rotary_emb",
    "compute_inv_freq",
    "gelu_activation",
    "silu_and_mul",
]
