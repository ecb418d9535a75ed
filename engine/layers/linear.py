"""A linear projection whose output may be several checkpoint projections stacked together."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        has_bias = self.bias is not None
        return f"input_size={self.input_size}, output_sizes={self.output_sizes}, bias={has_bias}"
