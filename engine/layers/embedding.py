"""Token embedding table (also the output projection when embeddings are tied)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """Looks token ids up in a `(vocab_size, hidden_size)` table filled by the loader."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: (num_tokens,) int64 -> (num_tokens, hidden_size)
        return F.embedding(input_ids, self.weight)
