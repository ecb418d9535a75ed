"""Async scheduling on the runner's side: sampled tokens that stay on the device.

With async scheduling the engine core launches step N+1 before it reads step N's tokens
(engine/core/in_flight.py). The runner therefore does not copy N's sampled ids to the host
before N+1 can start; instead:

1. after sampling N, every sampled row gets a placeholder (`PENDING_TOKEN_ID`) in its
   host state: one more output token and one more entry of the token-id table, so lengths,
   positions and seeded noise counters are right at once; the sampled ids stay in a device
   tensor, and their copy to the host starts without waiting (pinned memory and an event
   on a GPU; on the CPU the tensor is the host copy);
2. when step N+1 is prepared, the placeholders in its input ids (a decode's input is the
   token N sampled) are filled on the device from N's sampled tensor: no host round trip
   before N+1 launches. Every placeholder in a step's inputs must be filled this way; one
   that is not is a bug and fails the step;
3. `AsyncModelRunnerOutput.result()` waits for N's copy, writes the tokens over the
   placeholders (state and table, wherever the row is now) and returns N's
   `ModelRunnerOutput`.

What needs a token's value on the host waits for it, but only after the forward pass is
queued: a step runs in two halves, `forward_async` (the batch, the inputs, the model up to
the logits) and `sample_async`. When a row under a grammar or with a presence, frequency or
repetition penalty samples, the engine core reads step N back between the two: N's tokens
advance the grammars that fill N+1's bitmask, and the penalties count them on the host,
while the device computes N+1's forward pass.

On the CPU the same code runs, the device being the CPU: the placeholders, the fill of the
inputs from the previous step's tensor and the deferred host writes are what the CPU tests
exercise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, setitem
from typing import TYPE_CHECKING

import numpy as np
import torch
from kvferry.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvferry.engine.runner.input_batch import CachedRequestState, InputBatch

if TYPE_CHECKING:
    from kvferry.engine.sample.sampler import SamplerOutput

# The host's stand-in for a token still on the device: never a token id, so an input left
# unfilled fails loudly (an embedding lookup out of range) instead of computing garbage.
PENDING_TOKEN_ID = -1

# Prompt logprobs of a step: req_id -> (first position scored, entries).
PromptLogprobs = dict[str, tuple[int, list[list[tuple[int, float, int]]]]]
# Logprobs on the host: token ids (num_rows, k + 1), their values, the sampled tokens' ranks.
HostLogprobs = tuple[list[list[int]], list[list[float]], list[int]]


def pack_for_host(output: SamplerOutput) -> tuple[torch.Tensor, int | None]:
    """The step's sampled ids, and with logprobs, ids, values and ranks packed beside them
    as float64 (exact for all: ids and ranks are below 2^53, the values are float32), for
    one device-to-host copy. Returns the tensor and k (None without logprobs)."""
    sampled = output.sampled_token_ids  # (num_rows,) int64
    tensors = output.logprobs
    if tensors is None:
        return sampled, None
    k = tensors.token_ids.shape[1]
    packed = torch.cat([  # (num_rows, 2 + 2 * k) float64
        sampled[:, None].double(), tensors.token_ids.double(), tensors.logprobs.double(),
        tensors.ranks[:, None].double(),
    ], dim=1)
    return packed, k


def unpack_on_host(host: torch.Tensor, k: int | None) -> tuple[torch.Tensor, HostLogprobs | None]:
    """`pack_for_host`'s tensor, copied to the host, as sampled ids and logprobs lists."""
    if k is None:
        return host, None
    logprobs = (host[:, 1:1 + k].long().tolist(), host[:, 1 + k:1 + 2 * k].tolist(),
                host[:, 1 + 2 * k].long().tolist())
    return host[:, 0].long(), logprobs


def logprobs_lists(
    states: list[CachedRequestState], logprobs: HostLogprobs | None
) -> list[list[tuple[int, float, int]]] | None:
    """Per sampled row: [(sampled id, logprob, rank), (top-1 id, logprob, 1), ...] as many as
    its request asked for ([] for a row that asked for none); None without logprobs."""
    if logprobs is None:
        return None
    ids, values, ranks = logprobs
    result = []
    for i, state in enumerate(states):
        wanted = state.sampling_params.logprobs
        if wanted is None:
            result.append([])
            continue
        entries = [(ids[i][0], values[i][0], ranks[i])]
        entries += [(ids[i][j], values[i][j], j) for j in range(1, wanted + 1)]
        result.append(entries)
    return result


@dataclass(eq=False)
class ForwardPass:
    """A step run up to its logits, and what sampling them needs."""

    scheduler_output: SchedulerOutput
    # Rows that sample this step and their request states, in logits-row order.
    rows: list[int] = field(default_factory=list)
    states: list[CachedRequestState] = field(default_factory=list)
    # (len(rows), vocab_size) on the device; None when no row samples.
    logits: torch.Tensor | None = None
    prompt_logprobs: PromptLogprobs = field(default_factory=dict)

    @property
    def reads_host_outputs(self) -> bool:
        """Whether sampling reads the values of the rows' outputs on the host (presence,
        frequency and repetition penalties count them)."""
        return any(state.sampling_params.has_penalties for state in self.states)


@dataclass(eq=False)
class InFlightSamples:
    """One step's sampled tokens, on the device until resolved."""

    # The sampled rows' request states and ids, in logits-row order.
    states: list[CachedRequestState]
    req_ids: list[str]
    # Where each row's placeholder is: its position in the sequence (the token-id table's
    # column; max_model_len when the row was full) and its index among the outputs.
    positions: np.ndarray
    output_indices: np.ndarray
    # (num_rows,) int64 on the device: what the next step's inputs are filled from.
    sampled: torch.Tensor
    # The packed ids (and logprobs) being copied to the host, k, and the event that says
    # the copy is done (None on the CPU, where nothing is copied).
    host: torch.Tensor
    num_logprobs: int | None
    copied: torch.cuda.Event | None
    prompt_logprobs: PromptLogprobs = field(default_factory=dict)
    # Set once the tokens are on the host.
    output: ModelRunnerOutput | None = None
    # Whether a new request took the id of one of these rows' requests (which ended, or
    # was preempted) since: rows are then matched by state, not only by id.
    ids_reused: bool = False
    _id_set: set[str] | None = None

    def note_new_requests(self, req_ids: list[str]) -> None:
        if self._id_set is None:
            self._id_set = set(self.req_ids)
        if not self._id_set.isdisjoint(req_ids):
            self.ids_reused = True


class AsyncModelRunnerOutput:
    """A launched step's output; `result()` waits for its tokens to reach the host."""

    def __init__(self, tokens: PendingTokens | None, step: InFlightSamples | None,
                 output: ModelRunnerOutput | None = None) -> None:
        self._tokens = tokens
        self._step = step
        self._output = output

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> AsyncModelRunnerOutput:
        """A step that sampled nothing: its output is known at once."""
        return cls(None, None, output)

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            assert self._tokens is not None and self._step is not None
            self._output = self._tokens.resolve(self._step)
        return self._output


_output_token_ids = attrgetter("output_token_ids")
_req_id = attrgetter("req_id")


class PendingTokens:
    """The runner's steps whose sampled tokens are not on the host yet."""

    def __init__(self, batch: InputBatch) -> None:
        self.batch = batch
        # Unresolved steps, oldest first (one while the engine core keeps one step in flight).
        self.steps: list[InFlightSamples] = []

    def __bool__(self) -> bool:
        return bool(self.steps)

    def note_new_requests(self, req_ids: list[str]) -> None:
        """New request states enter the batch under these ids (a request new to the
        runner, or back after preemption)."""
        for step in self.steps:
            step.note_new_requests(req_ids)

    # ------------------------------------------------------------------ after sampling
    def defer(self, states: list[CachedRequestState], rows: list[int], output: SamplerOutput,
              prompt_logprobs: PromptLogprobs) -> AsyncModelRunnerOutput:
        """Gives the sampled rows their placeholders and starts the copy to the host."""
        batch = self.batch
        row_array = np.asarray(rows, dtype=np.int64)
        positions = batch.num_tokens[row_array].copy()
        output_indices = positions - batch.num_prompt_tokens[row_array]
        # map() with C-level callables: this runs every step over every sampled row.
        list(map(list.append, map(_output_token_ids, states), repeat(PENDING_TOKEN_ID)))
        batch.append_tokens(row_array, np.full(len(rows), PENDING_TOKEN_ID, dtype=np.int64))
        packed, k = pack_for_host(output)
        host, copied = packed, None
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        step = InFlightSamples(states, list(map(_req_id, states)), positions, output_indices,
                               output.sampled_token_ids, host, k, copied, prompt_logprobs)
        self.steps.append(step)
        return AsyncModelRunnerOutput(self, step)

    # ------------------------------------------------------------------ the next step
    def fill_inputs(self, input_ids: torch.Tensor, host_input_ids: np.ndarray,
                    query_start_loc: np.ndarray) -> None:
        """Fills the placeholders among a step's input ids (`input_ids` on the device,
        `host_input_ids` the host array it was copied from) from the device tensors of the
        steps that sampled them. RuntimeError when a placeholder has no such source."""
        missing = np.flatnonzero(host_input_ids == PENDING_TOKEN_ID)
        sources = [self._sources(step, query_start_loc) for step in self.steps]
        filled = [flat for flat, _ in sources if flat.size]
        num_filled = sum(map(len, filled))
        if num_filled != missing.size or (
                filled and not np.array_equal(np.sort(np.concatenate(filled)), missing)):
            raise RuntimeError(
                f"{missing.size} input ids of the step are tokens not sampled yet, and "
                f"{num_filled} come from a step in flight: the batch is inconsistent")
        for step, (flat, index) in zip(self.steps, sources):
            if not flat.size:
                continue
            # (2, n): targets in the step's inputs, sources in the sampled tensor.
            indices = _to_device(np.stack([flat, index]), input_ids.device)
            input_ids[indices[0]] = step.sampled[indices[1]].to(input_ids.dtype)

    def _sources(self, step: InFlightSamples,
                 query_start_loc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The flat input positions this step computes that hold one of `step`'s tokens,
        and those tokens' rows in its sampled tensor."""
        batch = self.batch
        num_reqs = len(query_start_loc) - 1
        rows = self._rows_now(step)
        live = (rows >= 0) & (rows < num_reqs)
        if not live.all():
            rows = np.where(live, rows, 0)
        starts, ends = query_start_loc[rows], query_start_loc[rows + 1]
        flat = starts + step.positions - batch.num_computed_tokens[rows]
        # Positions this step does not compute were fed by an earlier step already.
        chosen = np.flatnonzero(live & (flat >= starts) & (flat < ends))
        return flat[chosen].astype(np.int64), chosen

    def _rows_now(self, step: InFlightSamples) -> np.ndarray:
        """(num_rows,) each sampled request's row in the batch now; -1 where it has none,
        or where its id now belongs to another request (it ended, and the id was reused)."""
        batch = self.batch
        num = len(step.req_ids)
        rows = np.fromiter(map(batch.req_id_to_index.get, step.req_ids, repeat(-1, num)),
                           np.int64, num)
        if step.ids_reused:
            # Identity by id(): the state objects of the step are alive (it holds them).
            now = np.fromiter(map(id, map(batch.states.__getitem__, rows.tolist())), np.uint64,
                              num)
            rows[now != np.fromiter(map(id, step.states), np.uint64, num)] = -1
        return rows

    def resolve_all(self) -> None:
        """Waits for every pending token and writes it on the host (for what reads token
        values there: penalties)."""
        for step in list(self.steps):
            self.resolve(step)

    # ------------------------------------------------------------------ on the host
    def resolve(self, step: InFlightSamples) -> ModelRunnerOutput:
        """Waits for a step's copy, replaces its placeholders, returns its output."""
        if step.output is not None:
            return step.output
        if step.copied is not None:
            step.copied.synchronize()
        sampled, logprobs = unpack_on_host(step.host, step.num_logprobs)
        token_ids = sampled.tolist()
        self._write_tokens(step, token_ids, sampled.numpy())
        self.steps.remove(step)
        step.output = ModelRunnerOutput(step.req_ids, token_ids,
                                        logprobs_lists(step.states, logprobs),
                                        step.prompt_logprobs)
        return step.output

    def _write_tokens(self, step: InFlightSamples, token_ids: list[int],
                      tokens: np.ndarray) -> None:
        """The tokens over their placeholders: in each request's state (a state dropped
        meanwhile is written harmlessly), and in its table row if it still has one."""
        list(map(setitem, map(_output_token_ids, step.states), step.output_indices.tolist(),
                 token_ids))
        batch = self.batch
        rows = self._rows_now(step)
        live = (rows >= 0) & (step.positions < batch.max_model_len)
        batch.token_ids.np[rows[live], step.positions[live]] = tokens[live]


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on the device without waiting for the stream: on a GPU through
    pinned memory (a copy from pageable memory would wait for the step in flight)."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
