"""What crosses between the front end and the engine core, in one process or over a socket.

The front end (tokenizer, detokenizer, stop strings, `n > 1` fan-out) sends one
`EngineCoreRequest` per sequence to generate; the engine core (scheduler, KV cache, model
runner) answers every step with `EngineCoreOutputs`: only what the step added (new token
ids, this step's logprobs, finish reasons) and one snapshot of the scheduler's state, so
per-step traffic grows with the number of new tokens, not with what was generated before.

Every message is a msgspec struct (`array_like`: encoded as a msgpack array, not a map),
so the same objects go over ZMQ without a hand-written encoding.
"""

from __future__ import annotations

import enum
import warnings
from typing import TYPE_CHECKING, Any

import msgspec
from kvferry.engine.sampling_params import SamplingParams
from kvferry.kvtransfer.metrics import KVTransferStats
from kvferry.kvtransfer.params import KVTransferParams

from kvferry.protocol.block_hash import encoder_input_key, encoder_token_payload

if TYPE_CHECKING:
    import torch


class FinishReason(enum.IntEnum):
    """Why a sequence ended; `str()` is the OpenAI `finish_reason`."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    # The step computing the sequence failed; the engine went on serving the others.
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


# The dtypes a prompt embedding may cross in (the model dtypes), by name.
PROMPT_EMBEDS_DTYPES = ("float32", "bfloat16", "float16")


class PromptEmbeds(msgspec.Struct, array_like=True, frozen=True):
    """A prompt given as embeddings, as it crosses to the core: a `(num_tokens, hidden_size)`
    tensor's raw bytes (row-major) with its dtype and shape, not a list of floats."""

    data: bytes
    # A torch dtype name without "torch.": the model's dtype (the front end casts to it).
    dtype: str
    num_tokens: int
    hidden_size: int

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> PromptEmbeds:
        """The bytes of a 2-D CPU tensor (one copy)."""
        import torch

        dense = tensor.detach().to("cpu").contiguous()
        num_tokens, hidden_size = dense.shape
        data = dense.view(torch.uint8).numpy().tobytes()
        return cls(data, str(dense.dtype).removeprefix("torch."), num_tokens, hidden_size)

    def to_tensor(self) -> torch.Tensor:
        """A read-only view of the bytes as a `(num_tokens, hidden_size)` tensor (no copy);
        ValueError when the fields do not describe the bytes."""
        import torch

        if self.dtype not in PROMPT_EMBEDS_DTYPES:
            raise ValueError(f"prompt embeddings of dtype {self.dtype!r}; expected one of "
                             f"{', '.join(PROMPT_EMBEDS_DTYPES)}")
        dtype = getattr(torch, self.dtype)
        if self.num_tokens < 1 or self.hidden_size < 1:
            raise ValueError(f"prompt embeddings of shape ({self.num_tokens}, "
                             f"{self.hidden_size}); both sizes must be >= 1")
        expected = self.num_tokens * self.hidden_size * dtype.itemsize
        if len(self.data) != expected:
            raise ValueError(f"prompt embeddings of shape ({self.num_tokens}, "
                             f"{self.hidden_size}) {self.dtype} need {expected} bytes, got "
                             f"{len(self.data)}")
        with warnings.catch_warnings():
            # The bytes are immutable; the tensor is only ever read (rows are copied out).
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self.data, dtype=dtype)
        return flat.view(self.num_tokens, self.hidden_size)


class EncoderInput(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True):
    """An encoder-decoder request's encoder input as it crosses to the core: the encoder
    prompt's token ids (BART), or log-mel features (Whisper) as raw float32 bytes,
    row-major (num_mel_bins, num_frames)."""

    token_ids: list[int] = msgspec.field(default_factory=list)
    features: bytes = b""
    num_mel_bins: int = 0
    num_frames: int = 0
    # The encoder prompt as text, when it was given as text (outputs carry it back).
    text: str | None = None
    # Audio from an uploaded file: the sha256 of the file's bytes, which keys the input in
    # place of its features (a router computes the same key without decoding the file).
    source_digest: bytes = b""

    @property
    def is_audio(self) -> bool:
        return self.num_frames > 0

    @property
    def num_positions(self) -> int:
        """Encoder positions: one per token, or one per two frames (Whisper's stride-2
        convolution)."""
        return self.num_frames // 2 if self.is_audio else len(self.token_ids)

    def key(self) -> bytes:
        """The encoder input's hash (kvferry.protocol.block_hash.encoder_input_key)."""
        if self.source_digest:
            return encoder_input_key("audio-file", self.source_digest)
        if self.is_audio:
            shape = self.num_mel_bins.to_bytes(4, "little") + self.num_frames.to_bytes(4, "little")
            return encoder_input_key("audio", shape + self.features)
        return encoder_input_key("tokens", encoder_token_payload(self.token_ids))

    def features_tensor(self) -> torch.Tensor:
        """The features as a read-only (num_mel_bins, num_frames) float32 tensor (no copy);
        ValueError when the fields do not describe the bytes."""
        import torch

        expected = self.num_mel_bins * self.num_frames * 4
        if self.num_mel_bins < 1 or len(self.features) != expected:
            raise ValueError(f"audio features of shape ({self.num_mel_bins}, "
                             f"{self.num_frames}) float32 need {expected} bytes, got "
                             f"{len(self.features)}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only bytes, only read
            flat = torch.frombuffer(self.features, dtype=torch.float32)
        return flat.view(self.num_mel_bins, self.num_frames)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence to generate, already tokenized and validated by the front end."""

    # Unique among the engine's unfinished sequences (a child of an n > 1 request has its own).
    req_id: str
    # Empty when the prompt is given as embeddings (`prompt_embeds`).
    prompt_token_ids: list[int]
    # Validated on construction; the core trusts every field.
    sampling_params: SamplingParams
    # Token ids that end generation unless `ignore_eos` (the model's EOS ids).
    eos_token_ids: list[int]
    # Seconds on the front end's monotonic clock; orders requests under FCFS.
    arrival_time: float
    # Lower runs first under the priority policy.
    priority: int = 0
    # Extra prefix-cache key material (a hash of prompt embeddings or of an encoder input).
    cache_salt: bytes | None = None
    # The client's `kv_transfer_params`, parsed and validated once, by the front end; the
    # core passes them to its KV connector without reading them.
    kv_transfer_params: KVTransferParams | None = None
    # The prompt as embeddings, in place of prompt_token_ids; `cache_salt` then holds their
    # hash (kvferry.protocol.prompt_embeds.embeds_salt).
    prompt_embeds: PromptEmbeds | None = None
    # Encoder-decoder models: the encoder's input; prompt_token_ids are the decoder's.
    encoder: EncoderInput | None = None
    # Run only the encoder and leave the cross-attention KV in its blocks (cached, or held
    # by the KV connector); the request ends when the encoder step has run, with no token.
    encode_only: bool = False


# One sampled position: [(token_id, logprob, rank), ...], the sampled token first, then the
# top-N alternatives.
PositionLogprobs = list[tuple[int, float, int]]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step did for one sequence: the tokens it added, and whether it ended."""

    req_id: str
    new_token_ids: list[int]
    # One entry per new token, when the request asked for logprobs.
    new_logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    # The stop token id that ended the sequence (None for EOS, length and the rest).
    stop_reason: int | None = None
    # Prompt tokens served from the prefix cache; set on the sequence's first output.
    num_cached_tokens: int = -1
    # On a producer, the last output of a prefill held for a remote decode: the params
    # the decode hop must carry (vLLM's shape).
    kv_transfer_params: dict[str, Any] | None = None
    # Why the request failed (finish_reason ERROR), for the client.
    error: str | None = None
    # Finished (STOP) because its grammar is complete: the last token is output text, not
    # a stop token (structured outputs).
    grammar_ended: bool = False
    # Prompt logprobs this step computed (a prompt_logprobs request's prefill chunk): the
    # entries of prompt positions `prompt_logprobs_start`, `prompt_logprobs_start + 1`, ...
    # (position i is the prompt's token i given the tokens before it; i >= 1).
    new_prompt_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs_start: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True):
    """A snapshot of the scheduler after a step (counters are cumulative)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    # Fraction of KV blocks in use (0.0 - 1.0).
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # The transfer layer's counters; None when the engine has no KV connector.
    kv_transfer: KVTransferStats | None = None
    # Requests whose pull failed and were computed here instead (cumulative).
    num_kv_transfer_fallbacks: int = 0
    # Requests parked while a pull fills their blocks (included in num_waiting_reqs).
    num_waiting_for_remote_kv: int = 0
    # Block hashes the prefix cache started / stopped holding in this step (KV events;
    # a reader applies `evicted_block_hashes` first).
    stored_block_hashes: list[bytes] = msgspec.field(default_factory=list)
    evicted_block_hashes: list[bytes] = msgspec.field(default_factory=list)
    # Encoder-decoder models: requests waiting whose encoder has not run, encoder positions
    # run by this step, and cross-attention blocks held by requests (distinct blocks).
    num_waiting_for_encoder: int = 0
    num_step_encoder_tokens: int = 0
    num_cross_blocks: int = 0
    # KV events of cross-attention blocks, apart from the decoder's (the router predicts
    # from them which pods hold an encoder input's output).
    stored_cross_hashes: list[bytes] = msgspec.field(default_factory=list)
    evicted_cross_hashes: list[bytes] = msgspec.field(default_factory=list)
    # Encoder-decoder requests with an encoder pod's params: whose cross blocks were found
    # here already (no pull), and whose params named another input (computed here).
    num_cross_cache_hits: int = 0
    # Microbatches submitted and not yet updated (max_concurrent_batches > 1), and the
    # seconds each pipeline stage has spent on microbatches (cumulative; empty when the
    # executor does not say).
    num_microbatches_in_flight: int = 0
    stage_busy_seconds: list[float] = msgspec.field(default_factory=list)


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    """One step's outputs and the scheduler's state after it."""

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats
    # Sequences this step scheduled for the first time -> seconds they waited since arrival
    # (a sequence resumed after preemption is not counted again).
    queue_times: dict[str, float] = msgspec.field(default_factory=dict)


# Why a prompt of embeddings is refused by an engine started without the feature.
PROMPT_EMBEDS_DISABLED = ("prompt embeddings are disabled on this engine: start it with "
                          "enable_prompt_embeds=True (--enable-prompt-embeds)")


class EngineLimits(msgspec.Struct, array_like=True, frozen=True):
    """What a request must satisfy to ever be scheduled; checked by the front end and the core."""

    max_model_len: int
    vocab_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    # Prompts may be given as embeddings of `hidden_size` columns (enable_prompt_embeds).
    enable_prompt_embeds: bool = False
    hidden_size: int = 0
    # Encoder-decoder models: the longest encoder input in positions (0: decoder-only) and
    # what the encoder reads ("tokens" or "audio").
    max_encoder_len: int = 0
    encoder_input: str = ""

    @property
    def is_encoder_decoder(self) -> bool:
        return self.max_encoder_len > 0

    def check_encoder(self, encoder: EncoderInput | None) -> None:
        """Raises ValueError unless the encoder input suits this model (none for a
        decoder-only model; token ids in the vocabulary, or features of the right shape)."""
        if encoder is None:
            if self.is_encoder_decoder:
                raise ValueError("this is an encoder-decoder model: a request needs an "
                                 "encoder input")
            return
        if not self.is_encoder_decoder:
            raise ValueError("this model has no encoder: give a plain prompt, not an "
                             "encoder_prompt")
        if self.encoder_input == "audio":
            if encoder.token_ids or not encoder.is_audio:
                raise ValueError("this model's encoder reads audio, not token ids")
            encoder.features_tensor()  # checks that the bytes match the shape
            if encoder.num_positions != self.max_encoder_len:
                raise ValueError(f"audio features of {encoder.num_frames} frames; this model "
                                 f"takes exactly {2 * self.max_encoder_len}")
            return
        if encoder.is_audio or encoder.features:
            raise ValueError("this model's encoder reads token ids, not audio")
        if not encoder.token_ids:
            raise ValueError("the encoder prompt is empty: it must have at least one token")
        bad = next((t for t in encoder.token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"encoder prompt token id {bad} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if len(encoder.token_ids) > self.max_encoder_len:
            raise ValueError(f"the encoder prompt has {len(encoder.token_ids)} tokens, more "
                             f"than the encoder's maximum of {self.max_encoder_len}")

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raises ValueError naming the problem and the limit."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: it must have at least one token")
        vocab_size = self.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
        self._check_prompt_length(len(prompt_token_ids), "tokens")

    def check_prompt_embeds(self, num_tokens: int, hidden_size: int) -> None:
        """Raises ValueError unless the engine takes a prompt of embeddings of this shape."""
        if not self.enable_prompt_embeds:
            raise ValueError(PROMPT_EMBEDS_DISABLED)
        if hidden_size != self.hidden_size:
            raise ValueError(f"prompt_embeds has {hidden_size} columns; this model's "
                             f"hidden_size is {self.hidden_size}")
        if num_tokens < 1:
            raise ValueError("prompt_embeds has 0 rows: a prompt needs at least one")
        self._check_prompt_length(num_tokens, "rows of embeddings")

    def _check_prompt_length(self, num_tokens: int, unit: str) -> None:
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {num_tokens} {unit}, more than the maximum model length "
                f"of {self.max_model_len}"
            )
        # Without chunked prefill a prompt is computed in one step, so it must fit one.
        if not self.enable_chunked_prefill and num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"the prompt has {num_tokens} {unit}, more than max_num_batched_tokens="
                f"{self.max_num_batched_tokens}, and chunked prefill is disabled"
            )

    def check_params(self, params: SamplingParams) -> None:
        """Raises ValueError for fields that depend on the model (token ids in the vocabulary)."""
        for index, token_id in enumerate(params.stop_token_ids or ()):
            if token_id >= self.vocab_size:
                raise ValueError(
                    f"stop_token_ids[{index}] = {token_id} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        for token_id in params.logit_bias or ():
            if token_id >= self.vocab_size:
                raise ValueError(f"logit_bias names token {token_id}, outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        for index, token_id in enumerate(params.allowed_token_ids or ()):
            if token_id >= self.vocab_size:
                raise ValueError(f"allowed_token_ids[{index}] = {token_id} is outside the "
                                 f"vocabulary [0, {self.vocab_size})")


class EngineCoreInfo(msgspec.Struct, array_like=True, frozen=True):
    """What the front end learns from a loaded engine core."""

    # The checkpoint directory the core loaded (the front end reads its tokenizer there).
    model_dir: str
    architecture: str
    limits: EngineLimits
    # The model's EOS ids (from its config; the front end falls back to the tokenizer's).
    eos_token_ids: list[int]
    block_size: int
    # KV blocks in the pool, the null block included.
    num_blocks: int
    # The core runs a KV connector: requests may carry kv_transfer_params.
    kv_transfer_enabled: bool = False
    # The model's dtype (a torch dtype name): prompt embeddings are cast to it.
    dtype: str = "float32"


# ---------------------------------------------------------------- the engine-core socket
# `kvferry serve` runs the core in its own process (engine/frontend/core_process.py). Each message
# kind is its own tagged struct, so one msgpack decoder per direction reads a union of them.


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """Front end -> core: queue one sequence."""

    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    """Front end -> core: finish sequences wherever they are and free their blocks."""

    req_ids: list[str]
    # ABORT when the caller went away; STOP when the front end found a stop string.
    finish_reason: FinishReason = FinishReason.ABORT


class ShutdownCore(msgspec.Struct, tag=True, array_like=True):
    """Front end -> core: exit the loop and the process."""


CoreInput = AddRequest | AbortRequests | ShutdownCore


class CoreReady(msgspec.Struct, tag=True, array_like=True):
    """Core -> front end, once: the model is loaded and the loop is about to start."""

    info: EngineCoreInfo


class CoreStepOutputs(msgspec.Struct, tag=True, array_like=True):
    """Core -> front end, once per step (and once after inputs that left it idle)."""

    outputs: EngineCoreOutputs
    # AddRequest messages the core has received so far: the front end subtracts it from
    # what it sent to count the requests still in the socket, waiting but not in the stats.
    num_requests_received: int


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    """Core -> front end, last message: loading or the loop failed; the process exits."""

    # The exception's type and text, for the front end's error and the logs.
    message: str


CoreOutput = CoreReady | CoreStepOutputs | CoreFailed
