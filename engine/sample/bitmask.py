"""Token bitmasks of structured outputs applied to logits: disallowed tokens get -inf.

A bitmask row holds one bit per token id, packed in int32 words with the lowest bit first
(token t is word t // 32, bit t % 32), as the grammar engine writes it. The unpacking runs
on the logits' device over the packed rows, so a step copies 4 KiB per 32k-token row to the
device rather than a byte per token.
"""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(num_rows, num_words) int32 -> (num_rows, vocab_size) bool, True where allowed."""
    num_rows, num_words = bitmask.shape
    if num_words * 32 < vocab_size:
        raise ValueError(f"a bitmask of {num_words} words covers {num_words * 32} tokens, "
                         f"fewer than the vocabulary's {vocab_size}")
    # The int32 words as little-endian bytes, then each byte's bits lowest first.
    as_bytes = bitmask.contiguous().view(torch.uint8)  # (num_rows, num_words * 4)
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1  # (num_rows, num_words * 4, 8)
    return bits.view(num_rows, num_words * 32)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor,
                        bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with the tokens that row `rows[i]`'s bitmask `bitmask[i]` rules out at -inf.

    logits: (num_rows, vocab_size) float; rows: (num_masked,) int64; bitmask:
    (num_masked, num_words) int32 on the logits' device. The input is not modified.
    """
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # (num_masked, vocab_size)
    masked = logits[rows].masked_fill(~allowed, float("-inf"))
    out = logits.clone()
    out[rows] = masked
    return out
