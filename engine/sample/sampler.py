"""The sampler: one step's logits and their metadata in, one token per row out.

Order of processing (vLLM's):

1. rows under a grammar (structured outputs): tokens their bitmask rules out get -inf;
2. logit_bias added, and tokens outside a row's allowed_token_ids set to -inf;
3. block EOS/stop tokens of rows below min_tokens (-inf);
4. repetition, frequency and presence penalties;
5. greedy rows take the argmax of these logits;
6. the other rows are divided by their temperature, filtered by min-p, top-k and top-p,
   and sampled by the exponential race: argmax(probs / E) with E ~ Exponential(1) per
   token, which picks token i with probability probs[i] without a cumulative sum; a
   seeded row's E is a function of its seed and step (seeded_noise.py).

Logprobs, when asked for, are the log-softmax of the raw logits (before any of the above).
The input logits are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvferry.engine.sample.bitmask import apply_token_bitmask
from kvferry.engine.sample.filters import apply_min_p, apply_top_k_top_p
from kvferry.engine.sample.metadata import SamplingMetadata
from kvferry.engine.sample.penalties import apply_penalties, block_tokens
from kvferry.engine.sample.seeded_noise import seeded_exponential_noise


@dataclass
class LogprobsTensors:
    """Logprobs of the sampled tokens and of each row's top alternatives."""

    # (num_rows, k + 1) int64: column 0 is the sampled token, then the k most likely tokens.
    token_ids: torch.Tensor
    # (num_rows, k + 1) float32: raw log-softmax of the tokens in `token_ids`.
    logprobs: torch.Tensor
    # (num_rows,) int64: 1-based rank of the sampled token (1 + tokens strictly more likely).
    ranks: torch.Tensor


@dataclass
class SamplerOutput:
    """What one sampler call produces."""

    # (num_rows,) int64: the token sampled for each row.
    sampled_token_ids: torch.Tensor
    # None when no row asked for logprobs; k is metadata.max_num_logprobs for every row.
    logprobs: LogprobsTensors | None


class Sampler(torch.nn.Module):
    """Samples one token per logits row according to `SamplingMetadata`."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: (num_rows, vocab_size) float32; returns one token per row."""
        _check_logits(logits, metadata)
        raw_logits = logits
        logits = logits.float()
        logits = self.apply_logits_processors(logits, metadata)
        sampled = self.sample(logits, metadata)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = compute_logprobs(raw_logits, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def apply_logits_processors(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> torch.Tensor:
        """Grammar masks, token constraints, min_tokens blocking, then penalties: what
        greedy and random rows both see."""
        if metadata.grammar_bitmask is not None:
            logits = apply_token_bitmask(logits, metadata.grammar_rows, metadata.grammar_bitmask)
        logits = apply_token_constraints(logits, metadata)
        if metadata.blocked_rows is not None and metadata.blocked_token_ids is not None:
            logits = block_tokens(logits, metadata.blocked_rows, metadata.blocked_token_ids)
        if not metadata.no_penalties:
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
            )
        return logits

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """(num_rows,) int64: argmax for greedy rows, a random draw for the others."""
        greedy = None
        if not metadata.all_random:
            greedy = logits.argmax(dim=-1)
            if metadata.all_greedy:
                return greedy
        # Invariant: temperature (and is_greedy for mixed batches) exist unless all_greedy.
        assert metadata.temperature is not None
        logits = logits / metadata.temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.max_top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        sampled = exponential_race(probs, metadata)
        if greedy is None:
            return sampled
        return torch.where(metadata.is_greedy, greedy, sampled)


def apply_token_constraints(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """logit_bias and allowed_token_ids; `logits` itself is left as it is."""
    if metadata.bias_rows is not None:
        assert metadata.bias_token_ids is not None and metadata.bias_values is not None
        logits = logits.index_put((metadata.bias_rows, metadata.bias_token_ids),
                                  metadata.bias_values, accumulate=True)
    if metadata.allowed_rows is not None:
        assert metadata.allowed_mask is not None
        rows = metadata.allowed_rows
        restricted = logits[rows].masked_fill(~metadata.allowed_mask, float("-inf"))
        logits = logits.index_copy(0, rows, restricted)
    return logits


def exponential_race(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """(num_rows,) int64: argmax(probs / E), E ~ Exponential(1) i.i.d. per entry.

    probs[i] / E_i is the reciprocal of an exponential with rate probs[i], so the argmax is
    the first arrival of competing exponential clocks: token i wins with probability probs[i].
    Unseeded rows draw their noise from the default generator; seeded rows get theirs from
    `seeded_exponential_noise`, all of them in one pass, so a seeded request's tokens are
    the same whatever else is in the batch.
    """
    noise = torch.empty_like(probs)  # (num_rows, vocab_size)
    rows = metadata.seeded_rows
    if rows is None or rows.numel() < probs.shape[0]:
        noise.exponential_()
    if rows is not None:
        assert metadata.seeds is not None and metadata.seed_steps is not None
        seeded = seeded_exponential_noise(metadata.seeds, metadata.seed_steps, probs.shape[1])
        noise[rows] = seeded.to(probs.dtype)
    return (probs / noise).argmax(dim=-1)


def compute_logprobs(
    raw_logits: torch.Tensor, sampled_token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Raw logprobs of the sampled tokens, their ranks, and the top `num_logprobs` per row."""
    logprobs = raw_logits.float().log_softmax(dim=-1)  # (num_rows, vocab_size)
    sampled = sampled_token_ids.unsqueeze(1)  # (num_rows, 1)
    sampled_logprobs = logprobs.gather(1, sampled)  # (num_rows, 1)
    ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1  # (num_rows,)
    token_ids = sampled
    values = sampled_logprobs
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # (num_rows, k)
        token_ids = torch.cat([sampled, top_ids], dim=1)
        values = torch.cat([sampled_logprobs, top_logprobs], dim=1)
    return LogprobsTensors(token_ids=token_ids, logprobs=values, ranks=ranks)


def _check_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (num_rows, vocab_size), got shape {logits.shape}")
    num_rows, vocab_size = logits.shape
    if num_rows != metadata.num_rows:
        raise ValueError(
            f"logits have {num_rows} rows, but metadata.num_rows is {metadata.num_rows}"
        )
    if vocab_size != metadata.vocab_size:
        raise ValueError(
            f"logits have {vocab_size} columns, but metadata.vocab_size is {metadata.vocab_size}"
        )
