"""Async scheduling: the steps the scheduler has planned whose tokens have not come back.

With async scheduling the engine core schedules step N+1 before it applies step N's
sampled tokens (engine_core.py). Step N+1 is planned as if N's tokens were known: every
request N samples carries an output placeholder (`Request.num_output_placeholders`), so a
decode of N+1 computes the position of the token N is sampling, and its input is filled on
the device from N's sampled ids (runner/async_output.py). What the scheduler must remember
about a step until it is updated lives here:

- the `Request` objects it computes: a request that finished meanwhile (a stop token at
  step N ends a request already scheduled in N+1) may have its id taken by a new request
  before N+1 is updated, and N+1's token must not reach the newcomer;
- the hashes of the full blocks it computes and the encoder inputs it encodes, which enter
  the prefix cache only once it has run: a waiting request that would hit them waits a step,
  as it does for a block computed in the step being planned (see `Scheduler`'s invariant);
- the tokens it schedules: when step N is updated, a request's `num_computed_tokens`
  already counts step N+1's, which are not in the cache yet.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvferry.engine.core.request import Request
from kvferry.engine.core.scheduler_output import SchedulerOutput
from kvferry.engine.core.step_budget import StepBudget


@dataclass
class ScheduledStep:
    """One step scheduled and not yet updated."""

    output: SchedulerOutput
    # Every request it computes or encodes, by id.
    requests: dict[str, Request]
    # Hashes of the full blocks its tokens complete, and keys of the inputs it encodes
    # (empty without prefix caching: nothing waits for them then).
    block_hashes: set[bytes] = field(default_factory=set)
    encoder_keys: set[bytes] = field(default_factory=set)


class InFlightSteps:
    """Scheduled steps in order, oldest first (at most two: the one the device runs and the
    one planned behind it)."""

    def __init__(self, enable_caching: bool) -> None:
        self.enable_caching = enable_caching
        self.steps: list[ScheduledStep] = []

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[ScheduledStep]:
        return iter(self.steps)

    def add(self, output: SchedulerOutput, budget: StepBudget) -> None:
        """Records a step just scheduled, before its requests' `num_computed_tokens`
        advance (the hashes are of the blocks between the old and the new counts)."""
        requests = dict(budget.requests)
        for request in budget.encoder_requests:
            requests.setdefault(request.request_id, request)
        step = ScheduledStep(output, requests)
        if self.enable_caching:
            step.block_hashes = budget.filled_block_hashes()
            step.encoder_keys = set(budget.encoder_keys)
        self.steps.append(step)

    def pop(self, output: SchedulerOutput) -> ScheduledStep:
        """Forgets a step that is being updated (or failed); KeyError if it is unknown."""
        for index, step in enumerate(self.steps):
            if step.output is output:
                return self.steps.pop(index)
        raise KeyError("this step was not scheduled by this scheduler, or was updated already")

    def computes_block(self, block_hash: bytes) -> bool:
        return any(block_hash in step.block_hashes for step in self.steps)

    def encodes(self, encoder_key: bytes) -> bool:
        return any(encoder_key in step.encoder_keys for step in self.steps)

    def num_tokens_after(self, step: ScheduledStep) -> dict[str, int]:
        """Tokens scheduled per request by the steps after `step` (popped already: every
        step still here came after it)."""
        if len(self.steps) == 1:
            return self.steps[0].output.num_scheduled_tokens
        later: dict[str, int] = {}
        for other in self.steps:
            for req_id, num_tokens in other.output.num_scheduled_tokens.items():
                later[req_id] = later.get(req_id, 0) + num_tokens
        return later


def num_known_tokens(request: Request) -> int:
    """Tokens the scheduler may compute for a request: prompt and outputs, with its output
    placeholders (async scheduling); 0 when a placeholder's token reaches its length cap
    (that token ends it: nothing after it would be kept)."""
    pending = request.num_output_placeholders
    if pending and request.num_output_tokens + pending >= request.max_output_tokens:
        return 0
    return len(request.all_token_ids) + pending


def advance_with_placeholders(budget: StepBudget) -> None:
    """Async scheduling, after a schedule: advances each scheduled request's
    `num_computed_tokens`, and gives one more output placeholder to those whose tokens
    then reach the end of what they know (the step samples their next token)."""
    for request, num_tokens in zip(budget.requests.values(), budget.scheduled.values()):
        computed = request.num_computed_tokens + num_tokens
        request.num_computed_tokens = computed
        if computed >= len(request.all_token_ids) + request.num_output_placeholders:
            request.num_output_placeholders += 1
