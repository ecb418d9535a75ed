"""Whether a model's element-wise layers run PyTorch ops or kvferry's Triton kernels.

A Llama-family layer step has about fifteen small element-wise operations per layer
(RMSNorm with its residual add, SiLU-and-mul, rotary on q and k); in PyTorch each is one
or more kernel launches and a round trip through memory. The Triton kernels of
`kvferry.engine.attention.triton` do each in one launch. Modules that can use them carry a
class attribute `triton_kernels = False`; `use_triton_kernels` turns it on for every such
module of a model. The model loader does that when the attention backend is Triton (on a
GPU by default; under TRITON_INTERPRET=1 on CPU tensors, which is how CI runs them).
"""

from __future__ import annotations

from torch import nn


def use_triton_kernels(model: nn.Module) -> int:
    """Makes every module of `model` that has Triton kernels use them; returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(type(module), "triton_kernels"):
            module.triton_kernels = True
            count += 1
    return count
