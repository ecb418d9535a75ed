"""What the scheduler hands the model runner each step: only what changed.

The runner keeps its own copy of every running request (its persistent input batch), so a
step carries full data for requests the runner has not seen (new, or resumed after
preemption) and just the new block ids and progress of the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvferry.engine.core.messages import EncoderInput
from kvferry.engine.core.request import Request
from kvferry.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class NewRequestData:
    """A request the runner must (re)build a batch row for."""

    req_id: str
    # prompt + outputs so far: a request resumed after preemption recomputes them all.
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # The request's whole block table.
    block_ids: list[int]
    # Tokens already in the cache (prefix-cache hits) before this step.
    num_computed_tokens: int
    # Back after preemption (its output so far is in token_ids; a seeded request's noise
    # continues from its output length, so it samples what it would have unpreempted).
    is_resumed: bool = False
    # A prompt given as embeddings (num_prompt_tokens, hidden_size); its token_ids then
    # start with placeholders. The runner reads its rows while the prompt is computed.
    prompt_embeds: torch.Tensor | None = None
    # Encoder-decoder models: the request's cross-attention block table (whole, fixed for
    # its life in the batch) and its encoder positions.
    cross_block_ids: list[int] = field(default_factory=list)
    num_encoder_tokens: int = 0


@dataclass
class EncoderWork:
    """One request whose encoder runs this step, and where its cross-attention KV goes."""

    req_id: str
    encoder: EncoderInput
    cross_block_ids: list[int]


@dataclass
class CachedRequestData:
    """Progress of requests the runner already holds, in parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended to a request's table this step, for just the requests that got some.
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Tokens in the cache before this step.
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's plan."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens computed for it this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished or were aborted since the last step: drop their rows.
    finished_req_ids: set[str]
    # Requests preempted this step: drop their rows (they come back as new requests).
    preempted_req_ids: set[str]
    # Stop tokens each request must not sample yet (min_tokens not reached): req_id -> ids.
    blocked_stop_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Requests whose tokens complete at least one KV block this step; the scheduler indexes
    # those blocks in the prefix cache once the step has run (the runner ignores this).
    filling_req_ids: list[str] = field(default_factory=list)
    # Requests under a grammar (structured outputs) that sample a token this step: the
    # engine core fills their bitmask rows while the model runs. Empty in a step without
    # one, which then does no mask work at all.
    grammar_req_ids: list[str] = field(default_factory=list)
    # Encoder-decoder models: requests whose encoder runs this step, before the decoder
    # (a request that only encodes has no decoder tokens and no batch row).
    scheduled_encoder_inputs: list[EncoderWork] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0 and not self.scheduled_encoder_inputs

    @property
    def num_encoder_tokens(self) -> int:
        return sum(work.encoder.num_positions for work in self.scheduled_encoder_inputs)


@dataclass
class ModelRunnerOutput:
    """What one step computed: a sampled token for each request whose prompt is done."""

    # Requests that sampled a token this step (partial prefill chunks sample nothing).
    req_ids: list[str]
    sampled_token_ids: list[int]
    # Per sampled request: [(token_id, logprob, rank), ...] with the sampled token first,
    # then the top-N; None when no request asked for logprobs.
    logprobs: list[list[tuple[int, float, int]]] | None = None
    # Requests in prefill that asked for prompt logprobs -> (the first prompt position the
    # step computed, its entries in order): [(token_id, logprob, rank), top-N ...] each.
    prompt_logprobs: dict[str, tuple[int, list[list[tuple[int, float, int]]]]] = field(
        default_factory=dict)


def new_request_data(
    request: Request, block_ids: list[int], cross_block_ids: list[int] | None = None
) -> NewRequestData:
    """What the runner needs to build a row for a request it does not hold."""
    return NewRequestData(
        req_id=request.request_id,
        token_ids=list(request.all_token_ids),
        num_prompt_tokens=request.num_prompt_tokens,
        sampling_params=request.sampling_params,
        block_ids=block_ids,
        num_computed_tokens=request.num_computed_tokens,
        is_resumed=request.num_preemptions > 0,
        prompt_embeds=request.prompt_embeds,
        cross_block_ids=cross_block_ids or [],
        num_encoder_tokens=request.num_encoder_tokens,
    )
