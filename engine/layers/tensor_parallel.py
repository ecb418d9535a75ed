"""Tensor parallelism: how a layer's weights split across T ranks, and the layers that
compute with their shard and combine the ranks' results.

A Llama layer splits the Megatron way, one all-reduce per sub-block:
- the fused q/k/v projection and the fused gate/up projection are column-parallel: rank r
  holds its rows of each output block (its query heads and kv heads; its share of the MLP's
  intermediate columns), so attention and the activation run on local heads / columns;
- the output projection and the down projection are row-parallel: rank r holds the input
  columns matching its heads / intermediate columns, and the ranks' partial products are
  summed by an all-reduce (the bias is added once, after it);
- the embedding and the LM head are vocabulary-parallel: rank r holds rows
  [r * V/T, (r + 1) * V/T) of the (padded) vocabulary; a lookup of a token another rank
  holds gives zeros, summed by an all-reduce; logits are gathered along the vocabulary.

KV heads: with at least T of them each rank holds `num_kv_heads / T` (T must divide them);
with fewer, each is replicated on `T / num_kv_heads` consecutive ranks (T must be a
multiple), so rank r holds kv head `r * num_kv_heads // T`. A rank's KV cache then holds
its kv heads only.

Worked example, 8 query heads, 2 kv heads, head size 4, T = 4: rank 2 holds query heads
4-5 (q rows 16-23 of W_qkv), kv head 1 (k rows 32 + 4..8, v rows 40 + 4..8), and columns
16-23 of W_o.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from kvferry.engine.layers.linear import Linear
from torch import nn


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group (size 1: no group, no communication)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size} is invalid")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (in place)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds."""

    num_heads: int  # query heads here
    first_head: int  # the first of them
    num_kv_heads: int  # kv heads here
    first_kv_head: int


def shard_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadShard:
    """This rank's query and kv heads (see the module docstring); ValueError when the
    heads do not split evenly."""
    size, rank = tp.size, tp.rank
    if num_heads % size:
        raise ValueError(f"{num_heads} attention heads do not split over tensor-parallel "
                         f"size {size}")
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(f"{num_kv_heads} kv heads do not split over tensor-parallel "
                             f"size {size}")
        kv_per_rank, first_kv = num_kv_heads // size, rank * (num_kv_heads // size)
    else:
        if size % num_kv_heads:
            raise ValueError(f"tensor-parallel size {size} is not a multiple of the "
                             f"{num_kv_heads} kv heads, which would be replicated")
        kv_per_rank, first_kv = 1, rank * num_kv_heads // size
    per_rank = num_heads // size
    return HeadShard(per_rank, rank * per_rank, kv_per_rank, first_kv)


class ColumnParallelLinear(Linear):
    """A (fused) projection whose output rows split over the ranks, block by block: this
    rank holds `rows[i]` = (start, length) of each checkpoint block `i`."""

    def __init__(self, input_size: int, rows: list[tuple[int, int]], *, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__(input_size, [length for _, length in rows], bias=bias, dtype=dtype)
        self.rows = list(rows)

    def load_checkpoint_tensor(self, param: torch.Tensor, shard_index: int | None,
                               tensor: torch.Tensor) -> None:
        """Copies this rank's rows of checkpoint block `shard_index` (a weight or a bias)
        into their place in `param`."""
        index = shard_index or 0
        start, length = self.rows[index]
        first = sum(rows for _, rows in self.rows[:index])
        param[first:first + length].copy_(tensor[start:start + length])


class RowParallelLinear(Linear):
    """A projection whose input columns split over the ranks: each computes a partial
    product of its columns, summed by an all-reduce; the bias is added once, after it."""

    def __init__(self, columns: tuple[int, int], output_size: int, tp: TensorParallel, *,
                 bias: bool, dtype: torch.dtype) -> None:
        super().__init__(columns[1], [output_size], bias=bias, dtype=dtype)
        self.columns = columns
        self.tp = tp

    def load_checkpoint_tensor(self, param: torch.Tensor, shard_index: int | None,
                               tensor: torch.Tensor) -> None:
        """Copies this rank's columns of the checkpoint weight (the bias is whole)."""
        del shard_index
        if tensor.dim() == 1:
            param.copy_(tensor)
            return
        start, length = self.columns
        param.copy_(tensor[:, start:start + length])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, local input columns) -> (num_tokens, output_size)
        partial = F.linear(x, self.weight)
        self.tp.all_reduce(partial)
        return partial if self.bias is None else partial + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the vocabulary (padded to a multiple of the size) on this rank;
    a token another rank holds looks up zeros here, and the ranks' lookups are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel,
                 dtype: torch.dtype) -> None:
        super().__init__()
        per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * per_rank
        self.end = min(self.start + per_rank, vocab_size)
        self.vocab_size = vocab_size
        self.num_padded = per_rank
        self.tp = tp
        # Rows past the vocabulary (the last rank's padding) stay zero: no token reads them
        # and their logits are cut off.
        self.weight = nn.Parameter(torch.zeros(per_rank, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def load_checkpoint_tensor(self, param: torch.Tensor, shard_index: int | None,
                               tensor: torch.Tensor) -> None:
        """Copies this rank's rows of the checkpoint's embedding (or LM head) matrix."""
        del shard_index
        param[:self.end - self.start].copy_(tensor[self.start:self.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: (num_tokens,) int64 -> (num_tokens, hidden_size)
        local = input_ids - self.start
        here = (local >= 0) & (local < self.end - self.start)
        embeds = F.embedding(torch.where(here, local, 0), self.weight)
        embeds = embeds * here[:, None].to(embeds.dtype)
        return self.tp.all_reduce(embeds)

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits (n, vocab_size) of `hidden_states` (n, hidden_size), this matrix
        as the LM head: each rank's columns, gathered."""
        local = F.linear(hidden_states, self.weight).float()  # (n, per_rank)
        return self.tp.all_gather_last(local)[:, :self.vocab_size]
