"""The front end's second half: the core's per-step outputs turned into `RequestOutput`s.

Detokenization, stop strings, logprob decoding and `n > 1` fan-in happen here. A prompt
with `n` completions is one parent request whose children are separate sequences in the
core (`child_request_id`). What a caller receives each step depends on the request's
`RequestOutputKind`: everything so far, only what is new, or one final output.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvferry.engine.core.messages import (
    EncoderInput,
    EngineCoreOutput,
    FinishReason,
    PositionLogprobs,
)
from kvferry.engine.frontend.detokenizer import IncrementalDetokenizer
from kvferry.engine.frontend.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from kvferry.engine.frontend.stats import IterationStats
from kvferry.engine.frontend.tokenizer import Tokenizer
from kvferry.engine.sampling_params import SamplingParams


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a request holds."""

    # Everything generated so far (text, token ids, logprobs), every step.
    CUMULATIVE = 0
    # Only what is new since the previous output (streaming).
    DELTA = 1
    # One output, when the request finishes.
    FINAL_ONLY = 2


@dataclass
class ChildState:
    """Output-side state of one completion."""

    index: int
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Where the next delta output starts in token_ids / logprobs.
    num_tokens_sent: int = 0
    # Whether an output carrying the finish reason was handed out.
    is_final_sent: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_output(self, kind: RequestOutputKind) -> CompletionOutput:
        if kind == RequestOutputKind.DELTA:
            start, self.num_tokens_sent = self.num_tokens_sent, len(self.token_ids)
            text = self.detokenizer.get_delta(self.finished)
        else:
            start = 0
            text = self.detokenizer.output_text
        self.is_final_sent = self.finished
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.token_ids[start:],
            cumulative_logprob=self.cumulative_logprob if self.want_logprobs else None,
            logprobs=self.logprobs[start:] if self.want_logprobs else None,
            finish_reason=None if self.finish_reason is None else str(self.finish_reason),
            stop_reason=self.stop_reason,
        )


@dataclass
class ParentState:
    """One user request: its prompt and its completions."""

    request_id: str
    prompt: str | None
    # Empty for a prompt given as embeddings.
    prompt_token_ids: list[int]
    # Core request id -> completion state.
    children: dict[str, ChildState]
    metrics: RequestMetrics
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Prompt positions (token ids, or rows of embeddings), for the statistics.
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # From a producer's finished prefill: what the decode hop must carry.
    kv_transfer_params: dict[str, Any] | None = None
    # Why the core failed a completion, when it said.
    error: str | None = None
    # With prompt_logprobs: one entry per prompt position, filled as prefill chunks come
    # (every child computes the same prompt; a recomputed chunk rewrites the same entries).
    prompt_logprobs: PromptLogprobs | None = None
    # Encoder-decoder models: the encoder's prompt, as RequestOutput carries it.
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children.values())


def make_parent_state(
    tokenizer: Tokenizer,
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int],
    child_params: dict[str, SamplingParams],
    arrival_time: float,
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    num_prompt_tokens: int | None = None,
    encoder: EncoderInput | None = None,
) -> ParentState:
    """The output state of a request whose core requests are `child_params` (id -> params).

    A prompt given as embeddings has no `prompt_token_ids`: its text is decoded without
    prompt context, and `num_prompt_tokens` counts its rows."""
    children = {
        child_id: ChildState(
            index=index,
            detokenizer=IncrementalDetokenizer(tokenizer, prompt_token_ids, params),
            want_logprobs=params.logprobs is not None,
        )
        for index, (child_id, params) in enumerate(child_params.items())
    }
    parent = ParentState(
        request_id, prompt, prompt_token_ids, children, RequestMetrics(arrival_time),
        output_kind,
        len(prompt_token_ids) if num_prompt_tokens is None else num_prompt_tokens,
    )
    if any(p.prompt_logprobs is not None for p in child_params.values()):
        parent.prompt_logprobs = [None] * len(prompt_token_ids)
    if encoder is not None:
        parent.encoder_prompt = encoder.text
        parent.encoder_prompt_token_ids = list(encoder.token_ids)
    return parent


class OutputProcessor:
    """Keeps the output-side state of every unfinished request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, ParentState] = {}

    def add_request(self, parent: ParentState) -> None:
        if parent.request_id in self.parents:
            raise ValueError(f"request id {parent.request_id!r} is already in use")
        self.parents[parent.request_id] = parent
        for child_id in parent.children:
            self.child_to_parent[child_id] = parent

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput], stats: IterationStats
    ) -> tuple[list[RequestOutput], list[str]]:
        """Applies a step's outputs.

        Returns the request outputs to hand out, and the core request ids a stop string
        ended (the caller aborts them in the core, which cannot see text).
        """
        now = time.monotonic()
        touched: dict[str, ParentState] = {}
        stopped_by_string: list[str] = []
        for output in core_outputs:
            parent = self.child_to_parent.get(output.req_id)
            if parent is None:
                continue  # aborted by the caller while the step ran
            child = parent.children[output.req_id]
            if output.new_prompt_logprobs:
                self._place_prompt_logprobs(parent, output)
                if not output.new_token_ids and not output.finished:
                    continue  # a prefill chunk: nothing for the caller yet
            if child.finished:
                continue  # a stop string ended it; the core had sampled one more token
            stop = None
            if output.new_token_ids:
                self._record_timing(parent, child, output, now, stats)
                stop = self._append(child, output)
            if stop is not None:
                child.finish_reason, child.stop_reason = FinishReason.STOP, stop
                if not output.finished:
                    stopped_by_string.append(output.req_id)
            elif output.finished:
                child.finish_reason, child.stop_reason = output.finish_reason, output.stop_reason
            if output.kv_transfer_params is not None:
                parent.kv_transfer_params = output.kv_transfer_params
            if output.error is not None:
                parent.error = output.error
            touched[parent.request_id] = parent
        outputs = [
            out for p in touched.values() if (out := self._make_output(p, now, stats)) is not None
        ]
        return outputs, stopped_by_string

    def record_queue_times(self, queue_times: dict[str, float], stats: IterationStats) -> None:
        """Records, once per request, how long it waited until the core first scheduled it.

        `queue_times` maps core request ids to seconds; of an `n > 1` request the first
        child scheduled counts.
        """
        for req_id, seconds in queue_times.items():
            parent = self.child_to_parent.get(req_id)
            if parent is not None and parent.metrics.queue_time is None:
                parent.metrics.queue_time = seconds
                stats.queue_times.append(seconds)

    def _append(self, child: ChildState, output: EngineCoreOutput) -> str | None:
        child.token_ids.extend(output.new_token_ids)
        if child.want_logprobs and output.new_logprobs:
            for position in output.new_logprobs:
                self._append_logprobs(child, position)
        # A stop token id or EOS ended the sequence: its text is not part of the output (a
        # completed grammar ends it on a token of the output).
        stop_terminated = output.finish_reason == FinishReason.STOP and not output.grammar_ended
        return child.detokenizer.update(output.new_token_ids, stop_terminated=stop_terminated)

    def _place_prompt_logprobs(self, parent: ParentState, output: EngineCoreOutput) -> None:
        table = parent.prompt_logprobs
        if table is None:
            return
        assert output.new_prompt_logprobs is not None
        for offset, entries in enumerate(output.new_prompt_logprobs):
            index = output.prompt_logprobs_start + offset
            if 0 < index < len(table):
                table[index] = self._decode_position(entries)

    def _decode_position(self, entries: PositionLogprobs) -> dict[int, Logprob]:
        position: dict[int, Logprob] = {}
        for token_id, logprob, rank in entries:
            if token_id not in position:
                decoded = self.tokenizer.decode([token_id], skip_special_tokens=False)
                position[token_id] = Logprob(logprob, rank, decoded)
        return position

    def _append_logprobs(self, child: ChildState, entries: PositionLogprobs) -> None:
        child.cumulative_logprob += entries[0][1]
        child.logprobs.append(self._decode_position(entries))

    def _record_timing(
        self, parent: ParentState, child: ChildState, output: EngineCoreOutput, now: float,
        stats: IterationStats,
    ) -> None:
        if child.first_token_time is None:
            child.first_token_time = now
            stats.num_prompt_tokens += parent.num_prompt_tokens
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
                parent.num_cached_tokens = max(output.num_cached_tokens, 0)
                stats.time_to_first_tokens.append(now - parent.metrics.arrival_time)
        else:
            stats.inter_token_latencies.append(now - (child.last_token_time or now))
        if len(output.new_token_ids) > 1:  # tokens that arrived together are 0 s apart
            stats.inter_token_latencies.extend([0.0] * (len(output.new_token_ids) - 1))
        child.last_token_time = now
        parent.metrics.last_token_time = now
        stats.num_generation_tokens += len(output.new_token_ids)

    def _make_output(
        self, parent: ParentState, now: float, stats: IterationStats
    ) -> RequestOutput | None:
        finished = parent.finished
        if finished:
            self._forget(parent)
            parent.metrics.finished_time = now
            stats.e2e_latencies.append(now - parent.metrics.arrival_time)
            stats.finish_reasons.extend(str(c.finish_reason) for c in parent.children.values())
        kind = parent.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        children = sorted(parent.children.values(), key=lambda c: c.index)
        if kind == RequestOutputKind.DELTA:
            # Only completions that moved: new tokens, or a finish not yet handed out.
            children = [
                c for c in children
                if len(c.token_ids) > c.num_tokens_sent or (c.finished and not c.is_final_sent)
            ]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[c.to_output(kind) for c in children],
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics,
            kv_transfer_params=parent.kv_transfer_params,
            error=parent.error,
            prompt_logprobs=parent.prompt_logprobs,
            encoder_prompt=parent.encoder_prompt,
            encoder_prompt_token_ids=parent.encoder_prompt_token_ids,
        )

    def abort(
        self, request_ids: list[str], stats: IterationStats | None = None
    ) -> list[RequestOutput]:
        """Marks parents aborted; returns their final outputs (their latencies and finish
        reasons go to `stats` when given)."""
        stats = IterationStats() if stats is None else stats
        outputs = []
        for request_id in request_ids:
            parent = self.parents.get(request_id)
            if parent is None:
                continue
            for child in parent.children.values():
                if child.finish_reason is None:
                    child.finish_reason = FinishReason.ABORT
            output = self._make_output(parent, time.monotonic(), stats)
            if output is not None:
                outputs.append(output)
        return outputs

    def _forget(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for child_id in parent.children:
            self.child_to_parent.pop(child_id, None)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.children) if parent else []
