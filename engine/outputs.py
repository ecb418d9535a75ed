"""What the engine returns to its callers (the offline API and the server), in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One candidate token's log-probability at one output position."""

    logprob: float
    # 1-based rank among the vocabulary (1 = most likely).
    rank: int
    decoded_token: str | None = None


# Per output position: token id -> Logprob (the sampled token and the top-N alternatives).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One of a prompt's `n` completions, cumulative so far."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    # "stop", "length", "abort" once finished, else None.
    finish_reason: str | None = None
    # The stop string or stop token id that ended it (None for EOS or length).
    stop_reason: int | str | None = None
    # New since the previous output for this request (streaming); the text delta holds
    # back characters that might begin a stop string.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of one request."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request (all of its completions) after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
