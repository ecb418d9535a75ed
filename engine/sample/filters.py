"""Filters that narrow the distribution of randomly sampled rows: min-p, top-k, top-p.

Each filter takes per-row values as tensors, so one call handles rows with different
settings (a row whose value means "off" is left unchanged), and returns new logits with
the filtered-out tokens at -inf.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p` times the row's top probability.

    p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p), so no softmax is needed;
    min_p = 0 gives log(0) = -inf and drops nothing.
    logits: (num_rows, vocab_size); min_p: (num_rows,) float32.
    """
    max_logits = logits.amax(dim=-1, keepdim=True)  # (num_rows, 1)
    threshold = max_logits + torch.log(min_p).unsqueeze(1)  # (num_rows, 1)
    return logits.masked_fill(logits < threshold, NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's top_k most likely tokens, then the top-p nucleus of what is left.

    top_k: (num_rows,) int64, vocab_size meaning off; `max_top_k` is the largest enabled
    value (a host int). top_p: (num_rows,) float32, 1.0 meaning off. Without top-p only a
    partial `topk` is needed; with top-p the rows are sorted once for both filters.
    """
    if top_p is None:
        if top_k is None:
            return logits
        return _apply_top_k_only(logits, top_k, max_top_k)
    return _apply_top_k_top_p_sorted(logits, top_k, top_p)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Drop tokens below each row's k-th largest logit (ties with it are kept)."""
    vocab_size = logits.shape[1]
    top_values = logits.topk(max_top_k, dim=-1).values  # (num_rows, max_top_k), descending
    kth_index = (top_k.clamp(max=max_top_k) - 1).unsqueeze(1)  # (num_rows, 1)
    kth_value = top_values.gather(1, kth_index)  # (num_rows, 1)
    is_off = (top_k >= vocab_size).unsqueeze(1)
    threshold = kth_value.masked_fill(is_off, NEG_INF)
    return logits.masked_fill(logits < threshold, NEG_INF)


def _apply_top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k and top-p on logits sorted in descending order, mapped back by a scatter.

    Top-p keeps token j (in sorted order) when the mass of the tokens before it is still
    below p, i.e. the smallest prefix whose mass reaches p. Example with p = 0.7 and sorted
    probabilities [0.5, 0.3, 0.2]: masses before are [0, 0.5, 0.8], so the first two stay.
    The top token always stays because the mass before it is 0 < p.
    """
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # (num_rows, vocab_size)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        positions = torch.arange(vocab_size, device=logits.device)  # (vocab_size,)
        drop = positions.unsqueeze(0) >= top_k.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with p = 1 are skipped outright: rounding can push a cumulative sum past 1.0.
    nucleus_on = (top_p < 1.0).unsqueeze(1)
    drop = drop | (nucleus_on & (mass_before >= top_p.unsqueeze(1)))
    drop[:, 0] = False
    drop_by_token = torch.empty_like(drop).scatter_(1, sorted_ids, drop)
    return logits.masked_fill(drop_by_token, NEG_INF)
