"""Counter-based noise for seeded requests: a pure function of (seed, step, token id).

A seeded request's exponential noise at its `step`-th sampled token is computed, not drawn
from a stateful generator, so every seeded row of a batch gets its noise from one
vectorized pass (no per-row generator, no per-row launch), and a request's tokens depend
on nothing but its seed and its logits: not on the other rows, their order, the batch
size, or a preemption in between (the step is the number of tokens it has already
sampled, which a recomputed request reaches again).

The bits come from SplitMix64's finalizer, a bijective 64-bit mixer with full avalanche,
applied to (seed, step) and then to each token id; its top 24 bits become a uniform in
(0, 1) and `-log(u)` an Exponential(1) sample, never 0 (`exponential_of_top_bits`). Torch has no unsigned 64-bit arithmetic, so
the mixer runs on int64: products wrap modulo 2^64 exactly as unsigned ones do, and right
shifts are made logical by masking the sign-extended bits.
"""

from __future__ import annotations

import torch

_WRAP = 1 << 64
# SplitMix64's constants, as the int64 values with the same 64 bits.
_GAMMA = 0x9E3779B97F4A7C15 - _WRAP
_MUL1 = 0xBF58476D1CE4E5B9 - _WRAP
_MUL2 = 0x94D049BB133111EB - _WRAP
_UNIFORM_BITS = 24


def as_int64_seed(seed: int) -> int:
    """A seed of any size as the int64 with its low 64 bits."""
    seed &= _WRAP - 1
    return seed - _WRAP if seed >= 1 << 63 else seed


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shift_right(x, 30)) * _MUL1
    x = (x ^ _shift_right(x, 27)) * _MUL2
    return x ^ _shift_right(x, 31)


def seeded_exponential_noise(
    seeds: torch.Tensor,  # (num_rows,) int64
    steps: torch.Tensor,  # (num_rows,) int64: tokens each row has sampled before this one
    vocab_size: int,
) -> torch.Tensor:  # (num_rows, vocab_size) float32, Exponential(1) entries
    """The noise of each row's step, on the seeds' device."""
    keys = _mix(_mix(seeds + _GAMMA) + steps * _GAMMA)  # (num_rows,)
    token_ids = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device)
    bits = _mix(keys[:, None] + token_ids[None, :] * _GAMMA)  # (num_rows, vocab_size)
    # (k + 0.5) / 2^24 for the top 24 bits k: a uniform never 0 or 1, exact in float32.
    return exponential_of_top_bits(_shift_right(bits, 64 - _UNIFORM_BITS))


# The noise of the largest 24-bit value: -log(1 - 2^-25), which float32 arithmetic rounds
# to -log(1.0) = 0 (see below).
_MIN_NOISE = 2.0**-25


def exponential_of_top_bits(top: torch.Tensor) -> torch.Tensor:
    """Exponential(1) samples of uniform 24-bit integers `top` (int64, in [0, 2^24)).

    The uniform is (k + 0.5) / 2^24, never 0 or 1 in exact arithmetic, but in float32 the
    largest k rounds up to 2^24 and its noise to 0; a token whose probability is 0 (ruled out
    by top-k, top-p, min-p or a grammar) would then score 0 / 0 = NaN, which argmax takes
    as the largest. That one value is set to its true noise, 2^-25 (every other noise is at
    least 2^-24, so no other value changes).
    """
    uniform = (top.to(torch.float32) + 0.5) * (1.0 / (1 << _UNIFORM_BITS))
    return (-torch.log(uniform)).clamp_min_(_MIN_NOISE)
