"""What the engine returns to its callers (the offline API and the server), in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    """One candidate token's log-probability at one output position."""

    logprob: float
    # 1-based rank among the vocabulary (1 = most likely).
    rank: int
    decoded_token: str | None = None


# Per output position: token id -> Logprob (the sampled token and the top-N alternatives).
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position: the same, None for the first token (nothing comes before it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of a prompt's `n` completions: all of it so far, or (for a request whose output
    kind is DELTA) what is new since its previous output, the text holding back characters
    that might begin a stop string."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    # "stop", "length", "abort" or "error" once finished, else None.
    finish_reason: str | None = None
    # The stop string or stop token id that ended it (None for EOS or length).
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of one request."""

    arrival_time: float
    # Seconds from arrival until the core first scheduled one of the request's sequences.
    queue_time: float | None = None
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
    # On a prefill pod, once finished: the `kv_transfer_params` for the decode hop.
    kv_transfer_params: dict[str, Any] | None = None
    # Why the engine failed the request (finish_reason "error"), when it said.
    error: str | None = None
    # With SamplingParams.prompt_logprobs: per prompt position, None for the first, else
    # token id -> Logprob (the prompt's own token, then the top-N alternatives).
    prompt_logprobs: PromptLogprobs | None = None
    # Encoder-decoder models: the encoder's prompt (its text when given as text; None
    # for audio) and token ids (empty for audio); `prompt`/`prompt_token_ids` are the
    # decoder's.
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
