"""The front end's first half: prompts validated and tokenized, and the core requests of one
user request (one per completion of `n`).

Validation here uses the core's own `EngineLimits`, so a request the core would reject is
refused before it crosses to the core, with the same message.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from kvferry.engine.core.messages import (
    PROMPT_EMBEDS_DISABLED,
    EncoderInput,
    EngineCoreInfo,
    EngineCoreRequest,
    PromptEmbeds,
)
from kvferry.engine.frontend.encoder_prompts import EncoderDecoderPrompts, is_explicit_prompt
from kvferry.engine.frontend.tokenizer import Tokenizer
from kvferry.engine.sampling_params import SamplingParams
from kvferry.kvtransfer.admission import TransferAdmission
from kvferry.kvtransfer.params import KVTransferParams

from kvferry.protocol.prompt_embeds import (
    check_dense_floating,
    check_embeds,
    decode_prompt_embeds,
    embeds_salt,
    max_payload_bytes,
)

if TYPE_CHECKING:
    from kvferry.engine.structured_output.grammar import GrammarCompiler

# A prompt: text, token ids, or a dict with "prompt", "prompt_token_ids" or "prompt_embeds".
PromptType = str | list[int] | Mapping[str, Any]

# Separates a request id from a completion index in the id of a child of an `n > 1`
# request. Request ids may not contain it, so no id a caller sends can equal a child's.
CHILD_ID_SEPARATOR = "\x00"


def child_request_id(request_id: str, index: int) -> str:
    """The engine core's id of completion `index` of an `n > 1` request."""
    return f"{request_id}{CHILD_ID_SEPARATOR}{index}"


@dataclass
class ProcessedPrompt:
    """A prompt validated and tokenized, or given as embeddings and checked."""

    prompt: str | None
    # Empty for a prompt given as embeddings: it has no token ids.
    prompt_token_ids: list[int]
    # A prompt given as embeddings: (num_tokens, hidden_size), CPU, in the model's dtype.
    prompt_embeds: torch.Tensor | None = None
    # Their hash (`embeds_salt`): the extra prefix-cache key of the prompt's blocks.
    cache_salt: bytes | None = None
    # Encoder-decoder models: the encoder's input (`prompt`/`prompt_token_ids` are then the
    # decoder's prompt).
    encoder: EncoderInput | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt positions: token ids, or rows of embeddings."""
        if self.prompt_embeds is not None:
            return int(self.prompt_embeds.shape[0])
        return len(self.prompt_token_ids)

    @property
    def num_input_tokens(self) -> int:
        """The prompt's tokens as a request's usage counts them: the prompt positions, plus
        for an encoder-decoder model the encoder's (its prompt's tokens, or audio positions),
        so that a longer input never counts less."""
        return self.num_tokens + (0 if self.encoder is None else self.encoder.num_positions)


class InputProcessor:
    """Turns user requests into `EngineCoreRequest`s the core will accept."""

    def __init__(self, tokenizer: Tokenizer, info: EngineCoreInfo,
                 admission: TransferAdmission) -> None:
        self.tokenizer = tokenizer
        self.limits = info.limits
        # Which kv_transfer_params this pod acts on (signature, role, key); its counts are
        # exported beside the core's transfer metrics.
        self.admission = admission
        eos = info.eos_token_ids
        if not eos and tokenizer.eos_token_id is not None:
            eos = [tokenizer.eos_token_id]
        self.eos_token_ids = list(eos)
        # Prompt embeddings are cast to the model's dtype before they cross to the core.
        self.dtype: torch.dtype = getattr(torch, info.dtype)
        # Checks structured-output constraints as the core will compile them; made when the
        # first one arrives. Or why none can be made for this model (its tokenizer).
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_error: str | None = None
        self._grammar_lock = threading.Lock()
        # Encoder-decoder models: how prompts split between encoder and decoder.
        self.encoder_prompts = (
            EncoderDecoderPrompts(Path(info.model_dir), tokenizer)
            if self.limits.is_encoder_decoder else None)

    @property
    def is_encoder_pod(self) -> bool:
        """This engine serves an encoder pool: its requests run only their encoder and hand
        the cross-attention KV to a decode pod."""
        config = self.admission.config
        return config is not None and config.role == "encoder"

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """Tokenizes and validates a prompt; ValueError names the problem and the limit."""
        if isinstance(prompt, Mapping) and "prompt_embeds" in prompt:
            if self.encoder_prompts is not None:
                raise ValueError("this encoder-decoder model takes no prompt embeddings")
            return self.process_embeds(prompt["prompt_embeds"])
        if self.encoder_prompts is not None:
            return self._encoder_decoder_prompt(prompt)
        if is_explicit_prompt(prompt) or (isinstance(prompt, Mapping)
                                          and "multi_modal_data" in prompt):
            raise ValueError("this model has no encoder: give a plain prompt, not "
                             "encoder_prompt, decoder_prompt or multi_modal_data")
        text, token_ids = _split_prompt(prompt)
        if token_ids is None:
            self.check_text_fits(text or "")
            token_ids = self.tokenizer.encode(text or "")
        self.limits.check_prompt(token_ids)
        return ProcessedPrompt(text, list(token_ids))

    def _encoder_decoder_prompt(self, prompt: Any) -> ProcessedPrompt:
        assert self.encoder_prompts is not None
        if isinstance(prompt, str):
            self.check_text_fits(prompt)
        split = self.encoder_prompts.process(prompt)
        self.limits.check_encoder(split.encoder)
        self.limits.check_prompt(split.decoder_token_ids)
        return ProcessedPrompt(split.decoder_text, split.decoder_token_ids,
                               encoder=split.encoder)

    def process_embeds(self, tensor: Any) -> ProcessedPrompt:
        """A prompt given as a tensor of embeddings, checked (dense floating layout, 2-D after
        squeezing a leading 1, hidden_size columns, finite, 1..max_model_len rows), hashed
        and cast to the model's dtype; ValueError names the check that failed."""
        limits = self.limits
        if not limits.enable_prompt_embeds:
            raise ValueError(PROMPT_EMBEDS_DISABLED)
        if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
            tensor = tensor.detach().cpu()  # a no-op for a CPU tensor
        # The caller's own tensor is in memory already: no element cap to guard it.
        tensor = check_dense_floating(tensor, None)
        return self._embeds_prompt(check_embeds(tensor, limits.hidden_size,
                                                limits.max_model_len))

    def decode_prompt_embeds(self, text: str, where: str = "prompt_embeds") -> ProcessedPrompt:
        """A prompt sent as base64 of `torch.save(tensor)` bytes, decoded without trusting
        them (kvferry.protocol.prompt_embeds); ValueError names the check that failed. It
        parses, hashes and converts up to megabytes: callers on an event loop run it on a
        worker thread."""
        limits = self.limits
        if not limits.enable_prompt_embeds:
            raise ValueError(PROMPT_EMBEDS_DISABLED)
        max_bytes = max_payload_bytes(limits.max_model_len, limits.hidden_size)
        tensor = decode_prompt_embeds(text, limits.hidden_size, limits.max_model_len,
                                      max_bytes, where=where)
        return self._embeds_prompt(tensor)

    def _embeds_prompt(self, tensor: torch.Tensor) -> ProcessedPrompt:
        """A checked 2-D tensor as a prompt: its salt, then the cast (which copies at most once)."""
        self.limits.check_prompt_embeds(int(tensor.shape[0]), int(tensor.shape[1]))
        salt = embeds_salt(tensor)
        embeds = tensor.to(self.dtype).contiguous()
        return ProcessedPrompt(None, [], embeds, salt)

    def check_processed(self, prompt: ProcessedPrompt) -> None:
        """ValueError unless a prompt the caller built fits the core's limits."""
        self.limits.check_encoder(prompt.encoder)
        if prompt.prompt_embeds is None:
            self.limits.check_prompt(prompt.prompt_token_ids)
            return
        if not self.limits.enable_prompt_embeds:
            raise ValueError(PROMPT_EMBEDS_DISABLED)
        if prompt.cache_salt is None or prompt.prompt_embeds.dim() != 2:
            raise ValueError("a prompt of embeddings needs its salt and a 2-D tensor: build it "
                             "with process_prompt or decode_prompt_embeds")
        self.limits.check_prompt_embeds(*map(int, prompt.prompt_embeds.shape))

    def check_text_fits(self, text: str) -> None:
        """ValueError when `text` has too many characters to fit its limit in tokens: the
        maximum model length, or the encoder's maximum for a model whose encoder reads text
        (BART), as a text prompt is that encoder's input.

        Decided from the length alone, before tokenizing: a huge text is refused at once
        instead of holding the server while it is tokenized only to be refused.
        """
        longest = self.tokenizer.max_token_chars
        if longest is None:
            return
        min_tokens = -(-len(text) // longest)
        limit, name = self._text_limit()
        if min_tokens > limit:
            raise ValueError(
                f"the prompt has at least {min_tokens} tokens ({len(text)} characters, and no "
                f"token covers more than {longest}), more than {name} of {limit}")

    def _text_limit(self) -> tuple[int, str]:
        """The most tokens a text prompt may become, and the limit's name in messages."""
        limits = self.limits
        if limits.is_encoder_decoder and limits.encoder_input != "audio":
            return limits.max_encoder_len, "the encoder's maximum"
        return limits.max_model_len, "the maximum model length"

    def make_requests(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        kv_transfer_params: dict[str, Any] | KVTransferParams | None = None,
        encode_only: bool = False,
    ) -> list[EngineCoreRequest]:
        """The core requests of one user request: itself, or its `n` children.

        `kv_transfer_params`: the client's object, or params `admit_kv_transfer_params`
        returned already. `encode_only`: run only the encoder of an encoder-decoder
        prompt, leaving its cross-attention KV in the cache.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if CHILD_ID_SEPARATOR in request_id:
            raise ValueError("a request id may not contain the NUL character")
        self.limits.check_params(params)
        self.check_structured_outputs(params)
        if prompt.prompt_embeds is not None and params.prompt_logprobs is not None:
            raise ValueError(PROMPT_LOGPROBS_NEED_IDS)
        kv_transfer_params = self._check_kv_transfer_params(kv_transfer_params, params)
        embeds = (None if prompt.prompt_embeds is None
                  else PromptEmbeds.from_tensor(prompt.prompt_embeds))
        # An encoder pod (--role encoder) runs only encoders, whatever it is asked.
        encode_only = encode_only or self.is_encoder_pod
        if encode_only and (prompt.encoder is None or params.n != 1):
            raise ValueError("an encoder pod runs only the encoder of an encoder-decoder "
                             "prompt, for one completion (n=1)" if self.is_encoder_pod else
                             "encode_only needs an encoder-decoder prompt and n=1")
        if params.n == 1:
            children = [(request_id, params)]
        else:
            children = [
                (child_request_id(request_id, i), params.clone_for_child(i))
                for i in range(params.n)
            ]
        return [
            EngineCoreRequest(
                req_id=child_id,
                prompt_token_ids=prompt.prompt_token_ids,
                sampling_params=child_params,
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival_time,
                priority=priority,
                cache_salt=prompt.cache_salt,
                kv_transfer_params=kv_transfer_params,
                prompt_embeds=embeds,
                encoder=prompt.encoder,
                encode_only=encode_only,
            )
            for child_id, child_params in children
        ]

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """ValueError naming what is wrong with the request's constraint, if it has one: the
        grammar does not compile, or the model's tokenizer cannot take one. Compiled once per
        distinct constraint (the result is cached), with the core's tokenizer and vocabulary."""
        spec = params.structured_outputs
        if spec is None:
            return
        self._compiler().check(spec)

    def _compiler(self) -> GrammarCompiler:
        """The compiler, made once; ValueError when this model's tokenizer cannot take one."""
        with self._grammar_lock:
            if self._grammar_compiler is None and self._grammar_error is None:
                from kvferry.engine.structured_output.grammar import GrammarCompiler

                try:
                    self._grammar_compiler = GrammarCompiler(
                        self.tokenizer.to_json(), self.limits.vocab_size, self.eos_token_ids)
                except ValueError as exc:
                    self._grammar_error = str(exc)
            if self._grammar_compiler is None:
                raise ValueError(self._grammar_error)
            return self._grammar_compiler

    def admit_kv_transfer_params(self, data: dict[str, Any] | None) -> KVTransferParams | None:
        """Parses the client's object, once, and applies the pod's admission (admission.py).

        None: no params, or params refused under policy `recompute` (compute locally).
        Raises ValueError with the client's 400 message.
        """
        transfer = KVTransferParams.from_dict(data)
        return None if transfer is None else self.admission.admit(transfer)

    def _check_kv_transfer_params(
        self, data: dict[str, Any] | KVTransferParams | None, params: SamplingParams
    ) -> KVTransferParams | None:
        """Admitted params, typed (the core's KV connector reads them; the core does not)."""
        transfer = (data if isinstance(data, KVTransferParams)
                    else self.admit_kv_transfer_params(data))
        if transfer is not None and params.n != 1:
            raise ValueError("kv_transfer_params need n=1")
        return transfer


# Prompt logprobs score the prompt's own tokens; an embedding prompt has none.
PROMPT_LOGPROBS_NEED_IDS = ("prompt logprobs (prompt_logprobs, or echo with logprobs) score "
                            "the prompt's token ids; a prompt given as embeddings has none")


def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _token_list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError("'prompt' must be a string")
            return prompt["prompt"], None
        raise ValueError("a prompt dict needs 'prompt' (text), 'prompt_token_ids' (ints) or "
                         "'prompt_embeds' (a tensor)")
    if isinstance(prompt, (list, tuple)):
        return None, _token_list(prompt)
    raise ValueError(f"unsupported prompt type {type(prompt).__name__}; use str, ids or dict")


def _token_list(ids: Any) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise ValueError("prompt_token_ids must be a list of integers")
    return list(ids)
