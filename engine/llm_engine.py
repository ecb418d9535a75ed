"""The engine: requests in, one scheduled step at a time, outputs out.

`step()` is the whole loop body: schedule -> execute -> update. The server drives it from
its own loop; the offline `LLM` calls it until nothing is left.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvferry.engine.config import EngineConfig
from kvferry.engine.kv_cache import KVCacheManager
from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.models.loader import resolve_dtype
from kvferry.engine.models.source import resolve_model_source
from kvferry.engine.detokenizer import IncrementalDetokenizer
from kvferry.engine.output_processor import ChildState, OutputProcessor, ParentState
from kvferry.engine.outputs import RequestMetrics, RequestOutput
from kvferry.engine.request import Request, RequestStatus
from kvferry.engine.runner.model_runner import ModelRunner, determine_num_blocks
from kvferry.engine.sampling_params import SamplingParams
from kvferry.engine.scheduler import Scheduler
from kvferry.engine.stats import EngineStats, IterationStats, SchedulerStats
from kvferry.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# A prompt: text, token ids, or a dict with "prompt" or "prompt_token_ids".
PromptType = str | list[int] | Mapping[str, Any]


@dataclass
class ProcessedPrompt:
    """A prompt validated and tokenized."""

    prompt: str | None
    prompt_token_ids: list[int]


class LLMEngine:
    """One engine: tokenizer, scheduler, KV cache, model runner and output processing."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_cfg = config.model
        self.device = _resolve_device(config.device)
        torch.manual_seed(model_cfg.seed)
        self.model_dir = resolve_model_source(model_cfg.model)
        self.arch = ModelArchConfig.from_pretrained(self.model_dir)
        self.tokenizer = Tokenizer.from_pretrained(
            resolve_model_source(model_cfg.tokenizer) if model_cfg.tokenizer else self.model_dir
        )
        self.max_model_len = _resolve_max_model_len(model_cfg.max_model_len, self.arch)
        self.dtype = resolve_dtype(model_cfg.dtype, self.arch, self.device)
        self.eos_token_ids = tuple(self.arch.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        )
        sched_cfg = config.scheduler
        sched_cfg.max_model_len = self.max_model_len
        num_blocks = determine_num_blocks(self.arch, config.cache, self.dtype, self.device)
        self.runner = ModelRunner(
            self.model_dir, self.arch, self.dtype, self.device, config.cache, num_blocks,
            max_num_reqs=sched_cfg.max_num_seqs, max_model_len=self.max_model_len,
            max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
            attention_backend=config.attention_backend,
        )
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(sched_cfg, self.kv_cache_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self._num_preemptions = 0
        self._request_counter = itertools.count()
        logger.info(
            "engine ready: %s (%s) on %s, dtype %s, max_model_len %d, %d KV blocks",
            self.model_dir, self.arch.architecture, self.device, self.dtype,
            self.max_model_len, num_blocks,
        )

    @property
    def served_model_name(self) -> str:
        return self.config.model.served_model_name or self.config.model.model

    # ------------------------------------------------------------------ requests
    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """Tokenizes and validates a prompt; ValueError names the problem and the limit."""
        text, token_ids = _split_prompt(prompt)
        if token_ids is None:
            token_ids = self.tokenizer.encode(text or "")
        if not token_ids:
            raise ValueError("the prompt is empty: it must have at least one token")
        vocab_size = self.arch.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than the maximum model "
                f"length of {self.max_model_len}"
            )
        return ProcessedPrompt(text, list(token_ids))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | ProcessedPrompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queues a request (with `params.n` completions); raises ValueError on bad input."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = prompt if isinstance(prompt, ProcessedPrompt) else self.process_prompt(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        child_params = [params] if params.n == 1 else [
            params.clone_for_child(i) for i in range(params.n)
        ]
        child_ids = [request_id] if params.n == 1 else [
            f"{i}_{request_id}" for i in range(params.n)
        ]
        children = {}
        for index, (child_id, p) in enumerate(zip(child_ids, child_params)):
            children[child_id] = ChildState(
                index=index,
                detokenizer=IncrementalDetokenizer(self.tokenizer, processed.prompt_token_ids, p),
                want_logprobs=p.logprobs is not None,
            )
        parent = ParentState(
            request_id, processed.prompt, processed.prompt_token_ids, children,
            RequestMetrics(arrival_time=arrival),
        )
        self.output_processor.add_request(parent, child_ids)
        for child_id, p in zip(child_ids, child_params):
            self.scheduler.add_request(Request(
                request_id=child_id,
                prompt_token_ids=processed.prompt_token_ids,
                sampling_params=p,
                eos_token_ids=self.eos_token_ids,
                priority=priority,
                arrival_time=arrival,
            ))

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Aborts requests at any point; their blocks are freed at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        child_ids = [c for r in ids for c in self.output_processor.child_ids(r)]
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Runs one step: schedule, execute, update. Returns outputs of requests that moved."""
        scheduler_output = self.scheduler.schedule()
        self._num_preemptions += len(scheduler_output.preempted_req_ids)
        self.runner.forget_requests(scheduler_output.finished_req_ids)
        runner_output = self.runner.execute_model(scheduler_output)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        logprobs = dict(zip(runner_output.req_ids, runner_output.logprobs or []))
        iteration = IterationStats()
        outputs, stopped = self.output_processor.process(updates, logprobs, iteration)
        self.scheduler.finish_requests(
            [r.request_id for r in stopped], RequestStatus.FINISHED_STOPPED
        )
        self.stats.record(self._scheduler_stats(), iteration)
        return outputs

    def _scheduler_stats(self) -> SchedulerStats:
        running, waiting, usage = self.scheduler.make_stats()
        prefix = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            kv_cache_usage=usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self._num_preemptions,
        )

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks


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


def _resolve_max_model_len(requested: int | None, arch: ModelArchConfig) -> int:
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len {requested} is larger than the model's "
            f"max_position_embeddings of {limit}"
        )
    return requested


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {name!r}")
    return torch.device(name)
