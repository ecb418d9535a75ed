"""Logits processing that runs before greedy selection: min_tokens blocking and penalties.

Both functions return a new tensor and leave their input unchanged, so the sampler can
still compute raw logprobs from the logits it was given.
"""

from __future__ import annotations

import torch


def block_tokens(
    logits: torch.Tensor, blocked_rows: torch.Tensor, blocked_token_ids: torch.Tensor
) -> torch.Tensor:
    """Set `logits[blocked_rows[j], blocked_token_ids[j]]` to -inf for every pair j.

    Used for EOS and stop_token_ids of rows that have not reached min_tokens yet.
    """
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put((blocked_rows, blocked_token_ids), neg_inf)


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(num_rows, vocab_size + 1) float32 occurrences of each token in each padded row.

    `token_ids` is (num_rows, max_len) padded with `vocab_size`, so padding is counted in
    the extra last column. float32 counts are exact up to 2**24 occurrences.
    """
    num_rows = token_ids.shape[0]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    ones = torch.ones(token_ids.shape, dtype=torch.float32, device=token_ids.device)
    return counts.scatter_add_(1, token_ids, ones)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Apply the repetition, frequency and presence penalties, in that order.

    logits: (num_rows, vocab_size) float32. Token tensors are padded with vocab_size.
    `prompt_token_ids` may be None when no row has a repetition penalty.

    - repetition: for tokens seen in the prompt or the output, a positive logit is divided
      by the penalty and a negative one multiplied by it (penalty 1.0 changes nothing);
    - frequency: subtract penalty * (occurrences of the token in the output);
    - presence: subtract penalty * (1 if the token occurs in the output else 0).
    """
    num_rows, vocab_size = logits.shape
    # One extra column absorbs the pad id, so padded positions need no mask.
    padded = torch.cat([logits, logits.new_zeros(num_rows, 1)], dim=1)  # (num_rows, vocab + 1)
    if prompt_token_ids is not None:
        _apply_repetition_penalty(padded, prompt_token_ids, output_token_ids, repetition_penalties)
    counts = token_counts(output_token_ids, vocab_size)  # (num_rows, vocab + 1)
    padded.addcmul_(counts, frequency_penalties.unsqueeze(1), value=-1.0)
    present = counts.clamp_(max=1.0)  # (num_rows, vocab + 1): 1.0 where count > 0
    padded.addcmul_(present, presence_penalties.unsqueeze(1), value=-1.0)
    return padded[:, :vocab_size]


def _apply_repetition_penalty(
    padded_logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> None:
    """In place on the seen tokens only: O(num_rows * seen) rather than O(num_rows * vocab).

    A token seen several times is gathered several times, but every copy is penalized from
    the same original value, so the duplicate writes of the scatter agree.
    """
    seen = torch.cat([prompt_token_ids, output_token_ids], dim=1)  # (num_rows, num_seen)
    values = padded_logits.gather(1, seen)
    penalty = repetition_penalties.unsqueeze(1)  # (num_rows, 1)
    penalized = torch.where(values > 0, values / penalty, values * penalty)
    padded_logits.scatter_(1, seen, penalized)
