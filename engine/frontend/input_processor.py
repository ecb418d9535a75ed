"""The front end's first half: prompts validated and tokenized, and the core requests of one
user request (one per completion of `n`).

Validation here uses the core's own `EngineLimits`, so a request the core would reject is
refused before it crosses to the core, with the same message.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvferry.engine.core.messages import EngineCoreInfo, EngineCoreRequest
from kvferry.engine.frontend.tokenizer import Tokenizer
from kvferry.engine.sampling_params import SamplingParams
from kvferry.kvtransfer.admission import TransferAdmission
from kvferry.kvtransfer.params import KVTransferParams

if TYPE_CHECKING:
    from kvferry.engine.structured_output.grammar import GrammarCompiler

# A prompt: text, token ids, or a dict with "prompt" or "prompt_token_ids".
PromptType = str | list[int] | Mapping[str, Any]

# Separates a request id from a completion index in the id of a child of an `n > 1`
# request. Request ids may not contain it, so no id a caller sends can equal a child's.
CHILD_ID_SEPARATOR = "\x00"


def child_request_id(request_id: str, index: int) -> str:
    """The engine core's id of completion `index` of an `n > 1` request."""
    return f"{request_id}{CHILD_ID_SEPARATOR}{index}"


@dataclass
class ProcessedPrompt:
    """A prompt validated and tokenized."""

    prompt: str | None
    prompt_token_ids: list[int]


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
        # Checks structured-output constraints as the core will compile them; made when the
        # first one arrives. Or why none can be made for this model (its tokenizer).
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_error: str | None = None
        self._grammar_lock = threading.Lock()

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """Tokenizes and validates a prompt; ValueError names the problem and the limit."""
        text, token_ids = _split_prompt(prompt)
        if token_ids is None:
            self.check_text_fits(text or "")
            token_ids = self.tokenizer.encode(text or "")
        self.limits.check_prompt(token_ids)
        return ProcessedPrompt(text, list(token_ids))

    def check_text_fits(self, text: str) -> None:
        """ValueError when `text` has too many characters to fit max_model_len in tokens.

        Decided from the length alone, before tokenizing: a huge text is refused at once
        instead of holding the server while it is tokenized only to be refused.
        """
        longest = self.tokenizer.max_token_chars
        if longest is None:
            return
        min_tokens = -(-len(text) // longest)
        if min_tokens > self.limits.max_model_len:
            raise ValueError(
                f"the prompt has at least {min_tokens} tokens ({len(text)} characters, and no "
                f"token covers more than {longest}), more than the maximum model length of "
                f"{self.limits.max_model_len}")

    def make_requests(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        kv_transfer_params: dict[str, Any] | KVTransferParams | None = None,
    ) -> list[EngineCoreRequest]:
        """The core requests of one user request: itself, or its `n` children.

        `kv_transfer_params`: the client's object, or params `admit_kv_transfer_params`
        returned already.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if CHILD_ID_SEPARATOR in request_id:
            raise ValueError("a request id may not contain the NUL character")
        self.limits.check_params(params)
        self.check_structured_outputs(params)
        kv_transfer_params = self._check_kv_transfer_params(kv_transfer_params, params)
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
                kv_transfer_params=kv_transfer_params,
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
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (ints)")
    if isinstance(prompt, (list, tuple)):
        return None, _token_list(prompt)
    raise ValueError(f"unsupported prompt type {type(prompt).__name__}; use str, ids or dict")


def _token_list(ids: Any) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise ValueError("prompt_token_ids must be a list of integers")
    return list(ids)
