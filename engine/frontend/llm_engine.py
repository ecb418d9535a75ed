"""The engine in one process: the front end around an in-process engine core.

`step()` runs one core step (schedule -> execute -> update) and turns its outputs into
`RequestOutput`s. The offline `LLM` calls it until nothing is left; the server runs the
same front end (`InputProcessor`, `OutputProcessor`) against a core in its own process.
"""

from __future__ import annotations

from typing import Any

import itertools
import logging
import time

from kvferry.engine.config import EngineConfig
from kvferry.engine.core.engine_core import EngineCore
from kvferry.engine.core.kv_cache import KVCacheManager
from kvferry.engine.core.request import RequestStatus
from kvferry.engine.core.scheduler import Scheduler
from kvferry.engine.frontend.input_processor import InputProcessor, ProcessedPrompt, PromptType
from kvferry.engine.frontend.output_processor import (
    OutputProcessor,
    RequestOutputKind,
    make_parent_state,
)
from kvferry.engine.frontend.outputs import RequestOutput
from kvferry.engine.frontend.stats import EngineStats, IterationStats
from kvferry.engine.frontend.tokenizer import Tokenizer
from kvferry.engine.models.source import resolve_model_source
from kvferry.engine.runner.model_runner import ModelRunner
from kvferry.engine.sampling_params import SamplingParams
from kvferry.kvtransfer.admission import TransferAdmission

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "ProcessedPrompt", "PromptType", "RequestOutputKind"]


class LLMEngine:
    """Tokenizer, input and output processing, and an engine core, in one process."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine_core = EngineCore(config)
        core = self.engine_core
        tokenizer_dir = config.model.tokenizer
        self.tokenizer = Tokenizer.from_pretrained(
            resolve_model_source(tokenizer_dir) if tokenizer_dir else core.model_dir
        )
        self.input_processor = InputProcessor(self.tokenizer, core.info,
                                              TransferAdmission(config.kv_transfer))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self._request_counter = itertools.count()

    # The core's parts, for callers and tests that look inside.
    @property
    def scheduler(self) -> Scheduler:
        return self.engine_core.scheduler

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.engine_core.kv_cache_manager

    @property
    def runner(self) -> ModelRunner:
        return self.engine_core.runner

    @property
    def max_model_len(self) -> int:
        return self.engine_core.max_model_len

    @property
    def served_model_name(self) -> str:
        return self.config.model.served_model_name or self.config.model.model

    # ------------------------------------------------------------------ requests
    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """Tokenizes and validates a prompt; ValueError names the problem and the limit."""
        return self.input_processor.process_prompt(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | ProcessedPrompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        encode_only: bool = False,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        """Queues a request (with `params.n` completions); raises ValueError on bad input.

        `encode_only`: run only the encoder of an encoder-decoder prompt (see LLM.encode)."""
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = prompt if isinstance(prompt, ProcessedPrompt) else self.process_prompt(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        core_requests = self.input_processor.make_requests(
            request_id, processed, params, arrival, priority, kv_transfer_params,
            encode_only=encode_only,
        )
        self.output_processor.add_request(make_parent_state(
            self.tokenizer, request_id, processed.prompt, processed.prompt_token_ids,
            {r.req_id: r.sampling_params for r in core_requests}, arrival, output_kind,
            processed.num_tokens, processed.encoder,
        ))
        for request in core_requests:
            self.engine_core.add_request(request)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Aborts requests at any point; their blocks are freed at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        child_ids = [c for r in ids for c in self.output_processor.child_ids(r)]
        self.engine_core.abort_requests(child_ids)
        return self.output_processor.abort(ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def shutdown(self) -> None:
        """Stops the core's threads and worker processes."""
        self.engine_core.shutdown()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Runs one step: schedule, execute, update. Returns outputs of requests that moved."""
        core_outputs = self.engine_core.step()
        iteration = IterationStats()
        self.output_processor.record_queue_times(core_outputs.queue_times, iteration)
        outputs, stopped = self.output_processor.process_outputs(core_outputs.outputs, iteration)
        if stopped:
            self.engine_core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.stats.record(core_outputs.scheduler_stats, iteration)
        return outputs

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks
