"""A linear projection whose output may be several checkpoint projections stacked together.

On CPU in float32 a loaded model's weights can be prepacked once into MKL's GEMM layout
(`prepack_linear_weights`): a packed GEMM skips repacking the weight on every call, which
is most of the cost when few tokens run (decode steps), and gives identical results.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def mkl_prepack_available(weight: torch.Tensor) -> bool:
    """Whether `weight` can use MKL's packed float32 GEMM in this torch build."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def prepack_linear_weights(model: nn.Module) -> int:
    """Prepacks every `Linear` of `model` that can use the packed GEMM; returns how many."""
    packed = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.prepack():
            packed += 1
    if packed:
        logger.info("prepacked %d linear weights for MKL's float32 GEMM", packed)
    return packed


class Linear(nn.Module):
    """`y = x @ W.T (+ b)` with uninitialized weights, since the loader fills them.

    `output_sizes` lists the row blocks of `W`: a fused q/k/v projection has three
    (`[q_size, kv_size, kv_size]`), a plain projection one. The loader copies each
    checkpoint projection into its block, in that order.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        output_size = sum(self.output_sizes)
        # Parameters follow the ambient default device (the loader sets it).
        self.weight = nn.Parameter(
            torch.empty(output_size, input_size, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        # MKL's packed copy of `weight` (see `prepack`); the weight itself is kept, since
        # the loader and other code read it.
        self._packed_weight: torch.Tensor | None = None

    def prepack(self) -> bool:
        """Packs the loaded weight for MKL's GEMM; False where that is unavailable.

        Call after the weights are final: a later write to `weight` is not seen by the
        packed copy.
        """
        if not mkl_prepack_available(self.weight):
            return False
        # The batch size is only a tuning hint to the packer; the packed layout serves
        # any number of rows.
        self._packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.data, 64)
        return True

    def shard_rows(self, shard_index: int) -> tuple[int, int]:
        """Returns the `(start, end)` rows of `W` that output block `shard_index` occupies."""
        if not 0 <= shard_index < len(self.output_sizes):
            raise IndexError(
                f"shard index {shard_index} out of range for {len(self.output_sizes)} blocks"
            )
        start = sum(self.output_sizes[:shard_index])
        return start, start + self.output_sizes[shard_index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, input_size) -> (num_tokens, sum(output_sizes))
        if self._packed_weight is not None:
            rows = x.numel() // self.input_size
            return torch.ops.mkl._mkl_linear(x, self._packed_weight, self.weight, self.bias, rows)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        has_bias = self.bias is not None
        return f"input_size={self.input_size}, output_sizes={self.output_sizes}, bias={has_bias}"
