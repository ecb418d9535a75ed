"""A request's state as the scheduler and KV cache manager see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvferry.engine.core.kv_connector import TransferParams
from kvferry.engine.core.messages import EncoderInput, FinishReason
from kvferry.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from kvferry.engine.structured_output.manager import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    # Its blocks are allocated and a pull fills them from a remote producer: never
    # scheduled until the pull succeeds, fails or times out.
    WAITING_FOR_REMOTE_KV = enum.auto()
    # Its constraint (structured outputs) is being compiled: never scheduled until it is.
    WAITING_FOR_GRAMMAR = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # The step computing the request raised; its blocks were freed.
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why a finished request ended (None while it is not finished)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False)
class Request:
    """One sequence being generated: prompt, outputs and how much of it has KV."""

    request_id: str
    # For a prompt given as embeddings, one placeholder id per row (PLACEHOLDER_TOKEN_ID):
    # lengths, KV accounting and block hashes (with `cache_salt`) work on them unchanged.
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Token ids that end generation unless `ignore_eos` (the model's EOS ids).
    eos_token_ids: tuple[int, ...] = ()
    # Lower value runs first under the priority policy.
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # Extra prefix-cache key material that must match for blocks to be shared
    # (for example a hash of prompt embeddings); None when the tokens say it all.
    cache_salt: bytes | None = None
    # Remote-KV instructions (pull from a producer, or hold for a remote decode), opaque
    # to the core: only the KV connector reads them. Set to None once a pull is over, so a
    # preempted request recomputes instead of pulling again.
    kv_transfer_params: TransferParams = None
    # The prompt as embeddings, (num_prompt_tokens, hidden_size) on the CPU in the model's
    # dtype; None for a prompt of token ids. Dropped when the request finishes, so nothing
    # keeps a finished request's tensor alive.
    prompt_embeds: torch.Tensor | None = None
    # Encoder-decoder models: the encoder's input (prompt_token_ids are the decoder's), its
    # key (the hash its cross-attention blocks are cached under; also part of `cache_salt`,
    # since decoder KV depends on it), and, for a request that only runs its encoder
    # (leaving its cross blocks cached, e.g. an encoder pod), `encode_only`.
    encoder: EncoderInput | None = None
    encoder_key: bytes | None = None
    encode_only: bool = False

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # prompt + outputs; the scheduler schedules the tokens past num_computed_tokens.
    all_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache (or is being computed this step).
    num_computed_tokens: int = 0
    # Async scheduling: tokens scheduled steps will sample that have not come back yet
    # (0 or 1; always 0 in the synchronous loop). The next step is planned as if they were
    # in `all_token_ids`: a decode's input is the token its previous step is sampling.
    num_output_placeholders: int = 0
    # Prompt tokens served from the prefix cache when the request was first scheduled.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # The stop token id that ended the request.
    stop_reason: int | None = None
    # Chained hashes of the request's full blocks, filled in as blocks fill.
    block_hashes: list[bytes] = field(default_factory=list)
    # Set by the scheduler on arrival: outputs after which a length cap (max_tokens or
    # max_model_len) ends the request, and the token ids that may end it early.
    max_output_tokens: int = 0
    stop_token_set: frozenset[int] = frozenset()
    # Structured outputs: the request's grammar (compiling, then its matcher); None when
    # its output is unconstrained.
    grammar: RequestGrammar | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        # Computed once: the cross blocks' cache keys (block_hash.hash_cross_blocks).
        self.cross_block_hashes: list[bytes] = []

    @property
    def num_encoder_tokens(self) -> int:
        """Encoder positions (0 for a decoder-only request)."""
        return 0 if self.encoder is None else self.encoder.num_positions

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
