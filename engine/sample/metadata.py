"""What the sampler needs to know about the rows of one step's logits.

Row `i` of the logits is the `i`-th request being sampled this step. The runner builds a
`SamplingMetadata` once per step with `SamplingMetadata.build`; every per-row value is a
tensor on the logits' device, and every filter that no row uses is `None`, so a batch of
plain greedy or plain random requests skips that work entirely. The per-row arrays are
built on the host and reach the device together, one copy per dtype (uploads.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from kvferry.engine.sample.seeded_noise import as_int64_seed
from kvferry.engine.sample.uploads import PinnedUploads, upload
from kvferry.engine.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for one step, as tensors on the logits' device."""

    # Number of logits rows (requests sampled this step).
    num_rows: int
    # Width of the logits rows; padded token tensors use this value as their pad id.
    vocab_size: int
    # Every row is greedy: the sampler returns the argmax and draws no noise.
    all_greedy: bool
    # No row is greedy: the sampler skips the argmax and the final merge.
    all_random: bool
    # (num_rows,) bool, True for greedy rows; None when all_greedy or all_random.
    is_greedy: torch.Tensor | None
    # (num_rows,) float32 divisor of the logits; greedy rows hold 1.0. None when all_greedy.
    temperature: torch.Tensor | None
    # (num_rows,) float32 top-p per row (1.0 = off); None when no row uses top-p.
    top_p: torch.Tensor | None
    # (num_rows,) int64 top-k per row (vocab_size = off); None when no row uses top-k.
    top_k: torch.Tensor | None
    # Largest enabled top-k of any row (host int, so the sampler needs no device sync).
    max_top_k: int
    # (num_rows,) float32 min-p per row (0.0 = off); None when no row uses min-p.
    min_p: torch.Tensor | None
    # (num_seeded,) int64 rows of seeded requests, their seeds (as int64 bit patterns) and
    # how many tokens each has sampled before this step: their noise is a function of
    # these (seeded_noise.py). None when no random row is seeded.
    seeded_rows: torch.Tensor | None
    seeds: torch.Tensor | None
    seed_steps: torch.Tensor | None
    # Most logprobs any row asked for (0 = only the sampled token's); None when no row asked.
    max_num_logprobs: int | None
    # No row has a presence, frequency or repetition penalty.
    no_penalties: bool
    # (num_rows,) float32 per-row penalties; None when no_penalties.
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    # (num_rows, max_prompt_len) int64 prompt ids padded with vocab_size; only built when a
    # row has a repetition penalty (the only penalty that looks at the prompt).
    prompt_token_ids: torch.Tensor | None
    # (num_rows, max_output_len) int64 output ids padded with vocab_size; None when no_penalties.
    output_token_ids: torch.Tensor | None
    # (num_blocked,) int64 pairs (row, token id) of tokens that must not be sampled yet
    # because the row has fewer than min_tokens outputs; None when there are none.
    blocked_rows: torch.Tensor | None
    blocked_token_ids: torch.Tensor | None
    # Structured outputs: (num_masked, num_words) int32 token bitmasks (bitmask.py) of the
    # rows under a grammar this step, None when no row has one; and (num_masked,) int64
    # those rows, None when every row has one, in row order.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: torch.Tensor | None = None
    # (num_biased,) int64 pairs (row, token id) and the float32 bias added to each of those
    # logits (logit_bias); None when no row has a bias.
    bias_rows: torch.Tensor | None = None
    bias_token_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # (num_restricted,) int64 rows that may sample only some tokens, and a
    # (num_restricted, vocab_size) bool mask of those tokens (allowed_token_ids); None when
    # no row is restricted.
    allowed_rows: torch.Tensor | None = None
    allowed_mask: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        stop_token_ids_to_block: dict[int, list[int]],
        vocab_size: int,
        device: torch.device,
        grammar_bitmask: tuple[list[int], torch.Tensor] | None = None,
        pinned: PinnedUploads | None = None,
    ) -> SamplingMetadata:
        """Build the metadata for rows `0..len(params)-1`.

        `output_token_ids[i]` and `prompt_token_ids[i]` are row i's tokens so far (read only
        when a penalty needs them; a seeded row's output length is also its noise counter);
        `stop_token_ids_to_block` maps a row to the token ids (EOS
        and stop_token_ids) it must not sample yet because min_tokens is not reached;
        `grammar_bitmask` is (rows, their bitmask rows on the CPU) of rows under a grammar;
        `pinned`: the runner's pinned host buffers for the copy to a GPU.
        """
        num_rows = len(params)
        _check_row_lists(num_rows, output_token_ids, prompt_token_ids)
        _check_row_keys("stop_token_ids_to_block", stop_token_ids_to_block, num_rows)
        greedy = [p.is_greedy for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
        metadata = cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            is_greedy=None,
            temperature=None,
            top_p=None,
            top_k=None,
            max_top_k=0,
            min_p=None,
            seeded_rows=None,
            seeds=None,
            seed_steps=None,
            max_num_logprobs=max(logprob_counts) if logprob_counts else None,
            no_penalties=True,
            presence_penalties=None,
            frequency_penalties=None,
            repetition_penalties=None,
            prompt_token_ids=None,
            output_token_ids=None,
            blocked_rows=None,
            blocked_token_ids=None,
        )
        # Field name -> host array, moved to the device together at the end.
        arrays: dict[str, np.ndarray] = {}
        _blocked_pairs(stop_token_ids_to_block, vocab_size, arrays)
        if not all_greedy:
            metadata._fill_random(params, greedy, arrays)
            metadata._fill_seeds(params, greedy, output_token_ids, arrays)
        if any(p.has_penalties for p in params):
            metadata._fill_penalties(params, output_token_ids, prompt_token_ids, arrays)
        if any(p.has_token_constraints for p in params):
            metadata._fill_token_constraints(params, arrays)
        if grammar_bitmask is not None:
            metadata._fill_grammar(*grammar_bitmask, device, arrays)
        for name, tensor in zip(arrays, upload(list(arrays.values()), device, pinned)):
            setattr(metadata, name, tensor)
        return metadata

    def _fill_grammar(self, rows: list[int], bitmask: torch.Tensor, device: torch.device,
                      arrays: dict[str, np.ndarray]) -> None:
        _check_row_keys("grammar rows", dict.fromkeys(rows), self.num_rows)
        if len(rows) != bitmask.shape[0]:
            raise ValueError(f"{len(rows)} grammar rows for {bitmask.shape[0]} bitmask rows")
        if rows != list(range(self.num_rows)):
            arrays["grammar_rows"] = np.asarray(rows, dtype=np.int64)
        self.grammar_bitmask = bitmask.to(device, non_blocking=True)

    def _fill_token_constraints(self, params: list[SamplingParams],
                                arrays: dict[str, np.ndarray]) -> None:
        """logit_bias as flat (row, token, bias) triples; allowed_token_ids as row masks."""
        biased = [(row, p.logit_bias) for row, p in enumerate(params) if p.logit_bias]
        if biased:
            counts = [len(bias) for _, bias in biased]
            rows = np.repeat(np.array([row for row, _ in biased], dtype=np.int64), counts)
            token_ids = np.fromiter((t for _, bias in biased for t in bias), dtype=np.int64,
                                    count=len(rows))
            values = np.fromiter((b for _, bias in biased for b in bias.values()),
                                 dtype=np.float32, count=len(rows))
            _check_token_ids("logit_bias", token_ids, self.vocab_size)
            arrays.update(bias_rows=rows, bias_token_ids=token_ids, bias_values=values)
        restricted = [(row, p.allowed_token_ids) for row, p in enumerate(params)
                      if p.allowed_token_ids is not None]
        if restricted:
            mask = np.zeros((len(restricted), self.vocab_size), dtype=np.bool_)
            for index, (_, allowed) in enumerate(restricted):
                token_ids = np.asarray(allowed, dtype=np.int64)
                _check_token_ids("allowed_token_ids", token_ids, self.vocab_size)
                mask[index, token_ids] = True
            rows = np.array([row for row, _ in restricted], dtype=np.int64)
            arrays.update(allowed_rows=rows, allowed_mask=mask)

    def _fill_seeds(
        self, params: list[SamplingParams], greedy: list[bool],
        output_token_ids: list[list[int]], arrays: dict[str, np.ndarray],
    ) -> None:
        rows = [i for i, (p, g) in enumerate(zip(params, greedy)) if p.seed is not None and not g]
        if not rows:
            return
        seeds = [as_int64_seed(params[i].seed) for i in rows]  # type: ignore[arg-type]
        steps = [len(output_token_ids[i]) for i in rows]
        arrays.update(seeded_rows=np.asarray(rows, dtype=np.int64),
                      seeds=np.asarray(seeds, dtype=np.int64),
                      seed_steps=np.asarray(steps, dtype=np.int64))

    def _fill_random(
        self, params: list[SamplingParams], greedy: list[bool], arrays: dict[str, np.ndarray]
    ) -> None:
        """Temperature and the three filters; only called when some row samples randomly."""
        if not self.all_random:
            arrays["is_greedy"] = np.asarray(greedy, dtype=np.bool_)
        # Greedy rows divide by 1.0: their result comes from the argmax, not these logits.
        temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        arrays["temperature"] = _floats(temperatures)
        # Filters of greedy rows are switched off: they would only cost work.
        random_params = [p for p, g in zip(params, greedy) if not g]
        if any(p.top_p < 1.0 for p in random_params):
            arrays["top_p"] = _floats([1.0 if g else p.top_p for p, g in zip(params, greedy)])
        enabled_k = [min(p.top_k, self.vocab_size) for p in random_params if p.is_top_k_enabled]
        if enabled_k and min(enabled_k) < self.vocab_size:
            top_k = [
                min(p.top_k, self.vocab_size) if p.is_top_k_enabled and not g else self.vocab_size
                for p, g in zip(params, greedy)
            ]
            arrays["top_k"] = np.asarray(top_k, dtype=np.int64)
            self.max_top_k = max(k for k in enabled_k if k < self.vocab_size)
        if any(p.min_p > 0.0 for p in random_params):
            arrays["min_p"] = _floats([0.0 if g else p.min_p for p, g in zip(params, greedy)])

    def _fill_penalties(
        self,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        arrays: dict[str, np.ndarray],
    ) -> None:
        """Penalty values and the padded token tensors they read."""
        self.no_penalties = False
        arrays.update(
            presence_penalties=_floats([p.presence_penalty for p in params]),
            frequency_penalties=_floats([p.frequency_penalty for p in params]),
            repetition_penalties=_floats([p.repetition_penalty for p in params]),
            output_token_ids=_pad_token_ids(output_token_ids, self.vocab_size),
        )
        if any(p.repetition_penalty != 1.0 for p in params):
            arrays["prompt_token_ids"] = _pad_token_ids(prompt_token_ids, self.vocab_size)


def _check_row_lists(
    num_rows: int, output_token_ids: list[list[int]], prompt_token_ids: list[list[int]]
) -> None:
    if len(output_token_ids) != num_rows:
        raise ValueError(
            f"output_token_ids must have one list per row ({num_rows}), got {len(output_token_ids)}"
        )
    if len(prompt_token_ids) != num_rows:
        raise ValueError(
            f"prompt_token_ids must have one list per row ({num_rows}), got {len(prompt_token_ids)}"
        )


def _check_row_keys(name: str, mapping: dict[int, object], num_rows: int) -> None:
    for row in mapping:
        if not 0 <= row < num_rows:
            raise ValueError(f"{name} has row {row}, but rows must be in [0, {num_rows})")


def _floats(values: list[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def _pad_token_ids(rows: list[list[int]], pad_id: int) -> np.ndarray:
    """(num_rows, max_len) int64, each row's ids followed by `pad_id`.

    The pad id is vocab_size: scattering into a vocab_size + 1 wide table and dropping the
    last column then ignores padding without a mask.
    """
    max_len = max((len(ids) for ids in rows), default=0)
    table = np.full((len(rows), max_len), pad_id, dtype=np.int64)
    for row, ids in enumerate(rows):
        table[row, : len(ids)] = ids
    return table


def _check_token_ids(name: str, token_ids: np.ndarray, vocab_size: int) -> None:
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= vocab_size):
        bad = int(token_ids[(token_ids < 0) | (token_ids >= vocab_size)][0])
        raise ValueError(f"{name} has token id {bad}, but ids must be in [0, {vocab_size})")


def _blocked_pairs(
    stop_token_ids_to_block: dict[int, list[int]], vocab_size: int,
    arrays: dict[str, np.ndarray],
) -> None:
    """Flattens {row: [token ids]} into parallel (rows, token ids) index arrays."""
    items = [(row, ids) for row, ids in stop_token_ids_to_block.items() if ids]
    if not items:
        return
    counts = np.array([len(ids) for _, ids in items], dtype=np.int64)
    rows = np.repeat(np.array([row for row, _ in items], dtype=np.int64), counts)
    token_ids = np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids in items])
    if token_ids.min() < 0 or token_ids.max() >= vocab_size:
        bad = int(token_ids[(token_ids < 0) | (token_ids >= vocab_size)][0])
        raise ValueError(
            f"stop_token_ids_to_block has token id {bad}, but ids must be in [0, {vocab_size})"
        )
    arrays.update(blocked_rows=rows, blocked_token_ids=token_ids)
