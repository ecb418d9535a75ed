"""Turns sampled tokens into `RequestOutput`s: detokenization, stop strings, logprobs, n > 1.

A prompt with `n` completions is one parent request with `n` child requests in the
scheduler (ids `"{index}_{request_id}"`); its output gathers the children's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvferry.engine.detokenizer import IncrementalDetokenizer
from kvferry.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvferry.engine.request import Request
from kvferry.engine.stats import IterationStats
from kvferry.engine.tokenizer import Tokenizer


@dataclass
class ChildState:
    """Output-side state of one completion."""

    index: int
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None

    def to_output(self, finished: bool) -> CompletionOutput:
        delta_ids, self.delta_token_ids = self.delta_token_ids, []
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.output_text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.want_logprobs else None,
            logprobs=list(self.logprobs) if self.want_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            delta_text=self.detokenizer.get_delta(finished),
            delta_token_ids=delta_ids,
        )


@dataclass
class ParentState:
    """One user request: its prompt and its completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, ChildState]
    metrics: RequestMetrics
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    """Keeps the output-side state of every unfinished request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, parent: ParentState, child_ids: list[str]) -> None:
        self.parents[parent.request_id] = parent
        for child_id in child_ids:
            self.child_to_parent[child_id] = parent.request_id

    def process(
        self,
        updates: list[tuple[Request, list[int]]],
        logprobs: dict[str, list[tuple[int, float, int]]],
        stats: IterationStats,
    ) -> tuple[list[RequestOutput], list[Request]]:
        """Applies a step's new tokens; returns outputs and requests a stop string ended."""
        now = time.monotonic()
        touched: dict[str, ParentState] = {}
        stopped_by_string: list[Request] = []
        for request, new_token_ids in updates:
            parent = self.parents[self.child_to_parent[request.request_id]]
            child = parent.children[request.request_id]
            self._record_timing(parent, child, request, now, stats)
            stop = self._append(child, request, new_token_ids, logprobs.get(request.request_id))
            if stop is not None and not request.is_finished:
                request.stop_reason = stop
                stopped_by_string.append(request)
            if request.is_finished or stop is not None:
                child.finish_reason = "stop" if stop is not None else request.status.finish_reason
                child.stop_reason = stop if stop is not None else request.stop_reason
            touched[parent.request_id] = parent
        outputs = [self._make_output(p, now, stats) for p in touched.values()]
        return outputs, stopped_by_string

    def _append(
        self,
        child: ChildState,
        request: Request,
        new_token_ids: list[int],
        logprobs: list[tuple[int, float, int]] | None,
    ) -> str | None:
        child.token_ids.extend(new_token_ids)
        child.delta_token_ids.extend(new_token_ids)
        if child.want_logprobs and logprobs:
            self._append_logprobs(child, logprobs)
        stop_terminated = request.is_finished and request.status.finish_reason == "stop"
        return child.detokenizer.update(new_token_ids, stop_terminated=stop_terminated)

    def _append_logprobs(self, child: ChildState, entries: list[tuple[int, float, int]]) -> None:
        position: dict[int, Logprob] = {}
        for token_id, logprob, rank in entries:
            if token_id not in position:
                decoded = self.tokenizer.decode([token_id], skip_special_tokens=False)
                position[token_id] = Logprob(logprob, rank, decoded)
        child.cumulative_logprob += entries[0][1]
        child.logprobs.append(position)

    def _record_timing(
        self, parent: ParentState, child: ChildState, request: Request, now: float,
        stats: IterationStats,
    ) -> None:
        if child.first_token_time is None:
            child.first_token_time = now
            stats.num_prompt_tokens += request.num_prompt_tokens
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
                parent.num_cached_tokens = max(request.num_cached_tokens, 0)
                stats.time_to_first_tokens.append(now - parent.metrics.arrival_time)
        else:
            stats.inter_token_latencies.append(now - (child.last_token_time or now))
        child.last_token_time = now
        parent.metrics.last_token_time = now
        stats.num_generation_tokens += 1

    def _make_output(self, parent: ParentState, now: float, stats: IterationStats) -> RequestOutput:
        finished = parent.finished
        children = sorted(parent.children.values(), key=lambda c: c.index)
        outputs = [c.to_output(c.finish_reason is not None) for c in children]
        if finished:
            self._forget(parent)
            parent.metrics.finished_time = now
            stats.e2e_latencies.append(now - parent.metrics.arrival_time)
            stats.finish_reasons.extend(c.finish_reason or "" for c in children)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics,
        )

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Marks parents aborted; returns their final outputs."""
        outputs = []
        for request_id in request_ids:
            parent = self.parents.get(request_id)
            if parent is None:
                continue
            for child in parent.children.values():
                if child.finish_reason is None:
                    child.finish_reason = "abort"
            outputs.append(self._make_output(parent, time.monotonic(), IterationStats()))
        return outputs

    def _forget(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for child_id in parent.children:
            self.child_to_parent.pop(child_id, None)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.children) if parent else []
