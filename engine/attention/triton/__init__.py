"""Triton kernels for the engine, one module per operation, each beside the plain-torch
reference it must equal:

- `reshape_and_cache`: writes a step's keys and values into the paged cache at their slots;
- `unified_attention`: paged attention for prefill, chunked prefill and decode in one
  launch, causal or not, with split-KV reduced by `split_kv`;
- `encoder_attention`: the same kernel for encoder self-attention, non-causal over each
  request's own rows of the step's keys and values, with no cache;
- `rmsnorm`, `rotary`, `activation`: RMSNorm (optionally fused with the residual add),
  rotary embedding in place, SiLU-and-mul.

The public functions are re-exported here. Two share their module's name
(`reshape_and_cache`, `unified_attention`), so the package attribute is the function: to
reach such a module, write `from kvferry.engine.attention.triton.unified_attention import
...` rather than `import ... as`.

Importing never needs Triton (`HAS_TRITON` says whether it is installed): without it the
modules still import and the references work, and calling a kernel raises ImportError
saying what to install. On a machine without a GPU the kernels run on CPU tensors under
Triton's interpreter, which must be enabled (`TRITON_INTERPRET=1`) before these modules
are first imported.
"""

from kvferry.engine.attention.triton._runtime import HAS_TRITON
from kvferry.engine.attention.triton.activation import silu_and_mul, silu_and_mul_reference
from kvferry.engine.attention.triton.encoder_attention import (
    encoder_attention,
    encoder_attention_reference,
)
from kvferry.engine.attention.triton.reshape_and_cache import (
    reshape_and_cache,
    reshape_and_cache_reference,
)
from kvferry.engine.attention.triton.rmsnorm import (
    fused_add_rms_norm,
    rms_norm,
    rms_norm_reference,
)
from kvferry.engine.attention.triton.rotary import rotary_embedding, rotary_embedding_reference
from kvferry.engine.attention.triton.split_kv import choose_num_kv_splits
from kvferry.engine.attention.triton.unified_attention import (
    unified_attention,
    unified_attention_reference,
)

__all__ = [
    "HAS_TRITON",
    "choose_num_kv_splits",
    "encoder_attention",
    "encoder_attention_reference",
    "fused_add_rms_norm",
    "reshape_and_cache",
    "reshape_and_cache_reference",
    "rms_norm",
    "rms_norm_reference",
    "rotary_embedding",
    "rotary_embedding_reference",
    "silu_and_mul",
    "silu_and_mul_reference",
    "unified_attention",
    "unified_attention_reference",
]
