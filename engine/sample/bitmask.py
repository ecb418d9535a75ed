"""Token bitmasks of structured outputs applied to logits: disallowed tokens get -inf.

A bitmask row holds one bit per token id, packed in int32 words with the lowest bit first
(token t is word t // 32, bit t % 32), as the grammar engine writes it. The unpacking runs
on the logits' device over the packed rows, so a step copies 4 KiB per 32k-token row to the
device rather than a byte per token. The words are read as their little-endian bytes (the
byte order of x86-64, ARM64 and CUDA devices).
"""

from __future__ import annotations

import torch


def unpack_disallowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(num_rows, num_words) int32 -> (num_rows, vocab_size) bool, True where ruled out."""
    num_rows, num_words = bitmask.shape
    if num_words * 32 < vocab_size:
        raise ValueError(f"a bitmask of {num_words} words covers {num_words * 32} tokens, "
                         f"fewer than the vocabulary's {vocab_size}")
    as_bytes = bitmask.contiguous().view(torch.uint8)  # (num_rows, num_words * 4)
    # Made on the device (a kernel, not a host-to-device copy the host would wait on).
    bits = 1 << torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    ruled_out = (as_bytes.unsqueeze(-1) & bits) == 0  # (num_rows, num_words * 4, 8)
    return ruled_out.view(num_rows, num_words * 32)[:, :vocab_size]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(num_rows, num_words) int32 -> (num_rows, vocab_size) bool, True where allowed."""
    return ~unpack_disallowed(bitmask, vocab_size)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor | None,
                        bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with the tokens that row `rows[i]`'s bitmask `bitmask[i]` rules out at -inf.

    logits: (num_rows, vocab_size) float; rows: (num_masked,) int64, or None when the
    bitmask has one row per logits row, in order (the common case of a batch under grammars,
    done in one pass); bitmask: (num_masked, num_words) int32 on the logits' device. The
    input is not modified.
    """
    ruled_out = unpack_disallowed(bitmask, logits.shape[1])  # (num_masked, vocab_size)
    if rows is None:
        return logits.masked_fill(ruled_out, float("-inf"))
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(ruled_out, float("-inf"))
    return out
