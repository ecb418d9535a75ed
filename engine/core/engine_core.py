"""The engine core: scheduler, KV cache and model runner, one step at a time.

It knows token ids only. The front end (`LLMEngine` in one process, the server's engine
client across a socket) tokenizes, fans out `n > 1`, detokenizes and finds stop strings;
the core receives `EngineCoreRequest`s and returns, per step, the `EngineCoreOutputs` the
step produced.

With async scheduling (`SchedulerConfig.async_scheduling`) one step stays in flight: each
`step()` schedules and launches step N+1, then waits for step N, which the device computed
meanwhile, and returns N's outputs. On a GPU the host's scheduling, bookkeeping, stop checks
and output messages then run while the device computes, and N+1 is queued before N ends, so
the device does not wait for the host between steps. A step whose sampling needs N's tokens
on the host (a request under a grammar samples: its bitmask follows N's token; a row with a
penalty samples: its counts are built on the host) is launched in two halves: its forward
pass, then N is read back and updated, then its sampling, so the host's work still runs
while the device computes the forward pass. A step with nothing to compute updates N first.
On the CPU the device is the host, so the overlap saves nothing there; the same code runs,
which is what the CPU tests check (core/in_flight.py, runner/async_output.py).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from kvferry.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kvferry.engine.core.kv_cache import KVCacheManager
from kvferry.engine.core.kv_connector import start_kv_connector
from kvferry.engine.core.messages import (
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineLimits,
    FinishReason,
    SchedulerStats,
)
from kvferry.engine.core.request import Request, RequestStatus
from kvferry.engine.core.scheduler import Scheduler
from kvferry.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvferry.engine.executor.base import Executor, InProcessExecutor
from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.models.loader import resolve_dtype
from kvferry.engine.models.source import resolve_model_source
from kvferry.engine.runner.async_output import AsyncModelRunnerOutput
from kvferry.engine.runner.model_runner import ModelRunner, determine_num_blocks
from kvferry.engine.structured_output.manager import GrammarBitmask, StructuredOutputManager

from kvferry.protocol.prompt_embeds import PLACEHOLDER_TOKEN_ID

if TYPE_CHECKING:
    from kvferry.engine.executor.pipeline import PipelineExecutor

logger = logging.getLogger(__name__)

# Most seconds a step with nothing to compute waits for a grammar to compile (short: the
# engine-core process reads new requests and aborts between steps).
GRAMMAR_WAIT_S = 0.005


class EngineCore:
    """Loads the model and runs schedule -> execute -> update."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_cfg, cache_cfg, sched_cfg = config.model, config.cache, config.scheduler
        self.device = resolve_device(config.device)
        torch.manual_seed(model_cfg.seed)
        self.model_dir = resolve_model_source(model_cfg.model)
        self.arch = ModelArchConfig.from_pretrained(self.model_dir)
        self.max_model_len = resolve_max_model_len(model_cfg.max_model_len, self.arch)
        self.dtype = resolve_dtype(model_cfg.dtype, self.arch, self.device)
        sched_cfg.max_model_len = self.max_model_len
        max_encoder_len = resolve_encoder_budget(sched_cfg, self.arch)
        if (config.kv_transfer is not None and config.kv_transfer.role == "encoder"
                and not self.arch.is_encoder_decoder):
            raise ValueError(f"--role encoder serves the encoder of an encoder-decoder model "
                             f"(BART, Whisper); {self.arch.architecture} has none")
        # What runs the steps: the model runner of this process, or (pipeline parallelism)
        # the stages' worker processes (engine/executor/pipeline.py), and then no runner.
        self.runner: ModelRunner | None = None
        self.executor: Executor
        # The NIXL agent name of a pipeline's transfers (its ranks' agents derive theirs).
        self._transfer_agent_name: str | None = None
        if config.parallel.world_size > 1:
            pipeline = self._start_pipeline()
            self.executor = pipeline
            num_blocks = pipeline.num_blocks()
            try:
                check_kv_cache_fits(num_blocks, cache_cfg, self.max_model_len, self.device,
                                    max_encoder_len)
                pipeline.initialize_kv_cache(num_blocks, self._rank_agent_specs(pipeline))
            except BaseException:  # no worker outlives a core that did not start
                pipeline.shutdown()
                raise
        else:
            self.runner = ModelRunner(
                self.model_dir, self.arch, self.dtype, self.device, cache_cfg,
                max_num_reqs=sched_cfg.max_num_seqs, max_model_len=self.max_model_len,
                max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
                attention_backend=config.attention_backend,
                transfer_memory=config.kv_transfer is not None,
            )
            # The weights are loaded: on a GPU, a profiling step of the largest size tells
            # what the KV cache may take (memory_profile.py).
            gpu_budget = (
                None if cache_cfg.num_gpu_blocks_override is not None
                else self.runner.measure_kv_cache_budget(
                    cache_cfg.gpu_memory_utilization, sched_cfg.max_num_seqs,
                    sched_cfg.max_num_encoder_tokens or 0,
                    decode_graphs=self.uses_decode_graphs)
            )
            num_blocks = determine_num_blocks(self.arch, cache_cfg, self.dtype, gpu_budget)
            check_kv_cache_fits(num_blocks, cache_cfg, self.max_model_len, self.device,
                                max_encoder_len)
            self.runner.initialize_kv_cache(num_blocks)
            if self.uses_decode_graphs:
                self.runner.enable_decode_graphs()
            self.executor = InProcessExecutor(self.runner)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching
        )
        try:
            self.kv_connector = (
                None if config.kv_transfer is None
                else start_kv_connector(config.kv_transfer, self._transfer_caches(),
                                        cache_cfg.block_size,
                                        (config.parallel.pipeline_parallel_size,
                                         config.parallel.tensor_parallel_size),
                                        self._transfer_agent_name)
            )
        except BaseException:  # no worker outlives a core that did not start
            self.executor.shutdown()
            raise
        # Grammars of structured outputs; llguidance loads with the first constraint.
        tokenizer_dir = (resolve_model_source(model_cfg.tokenizer) if model_cfg.tokenizer
                         else self.model_dir)
        self.structured_output = StructuredOutputManager(
            tokenizer_dir, self.arch.vocab_size, sched_cfg.max_num_seqs, self.device)
        self.scheduler = Scheduler(
            sched_cfg, self.kv_cache_manager,
            None if self.kv_connector is None else self.kv_connector.scheduler,
            self.structured_output,
        )
        # Async scheduling: the step launched and not yet updated.
        self._in_flight: tuple[SchedulerOutput, AsyncModelRunnerOutput] | None = None
        # (max_concurrent_batches > 1) The microbatches submitted to the executor and not
        # yet updated, oldest first.
        self._microbatches: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        self.info = EngineCoreInfo(
            model_dir=str(self.model_dir),
            architecture=self.arch.architecture,
            limits=EngineLimits(
                max_model_len=self.max_model_len,
                vocab_size=self.arch.vocab_size,
                max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
                enable_chunked_prefill=sched_cfg.enable_chunked_prefill,
                enable_prompt_embeds=model_cfg.enable_prompt_embeds,
                hidden_size=self.arch.hidden_size,
                max_encoder_len=max_encoder_len,
                encoder_input=self.arch.encoder_input if max_encoder_len else "",
            ),
            eos_token_ids=list(self.arch.eos_token_ids),
            block_size=cache_cfg.block_size,
            num_blocks=num_blocks,
            kv_transfer_enabled=self.kv_connector is not None,
            dtype=str(self.dtype).removeprefix("torch."),
        )
        logger.info(
            "engine core ready: %s (%s) on %s, dtype %s, max_model_len %d, %d KV blocks",
            self.model_dir, self.arch.architecture, self.device, self.dtype,
            self.max_model_len, num_blocks,
        )

    @property
    def uses_decode_graphs(self) -> bool:
        """Whether decode-only steps replay CUDA graphs: on a GPU with the Triton backend,
        unless `enforce_eager`. The torch backend plans its decodes on the host from each
        step's lengths, and encoder-decoder models' cross-attention is not in the graphs:
        those run eagerly. Pipeline stages run eagerly too."""
        return (self.runner is not None and self.device.type == "cuda"
                and not self.config.enforce_eager
                and self.runner.attn_backend.name == "triton"
                and not self.arch.is_encoder_decoder)

    def _start_pipeline(self) -> PipelineExecutor:
        """Starts the pipeline's worker processes (each loads its stage) and keeps as many
        microbatches in flight as there are stages, unless `max_concurrent_batches` says
        otherwise; ValueError for what a pipeline cannot run yet."""
        from kvferry.engine.executor.pipeline import PipelineExecutor

        config, sched_cfg = self.config, self.config.scheduler
        parallel = config.parallel
        sizes = (f"pipeline_parallel_size {parallel.pipeline_parallel_size} and "
                 f"tensor_parallel_size {parallel.tensor_parallel_size}")
        if sched_cfg.async_scheduling:
            raise ValueError(f"async_scheduling with {sizes} is not available yet: the "
                             "stages overlap microbatches instead")
        pipeline = PipelineExecutor(
            self.model_dir, self.arch, self.dtype, self.device, config.cache, config.parallel,
            max_num_reqs=sched_cfg.max_num_seqs, max_model_len=self.max_model_len,
            max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
            attention_backend=config.attention_backend, seed=config.model.seed,
        )
        if sched_cfg.max_concurrent_batches == 1:
            sched_cfg.max_concurrent_batches = pipeline.max_concurrent_batches
        return pipeline

    def _rank_agent_specs(self, pipeline: PipelineExecutor) -> list[Any] | None:
        """With KV transfer, the NIXL agent each of the pipeline's workers starts for its
        rank's cache (kvtransfer/ranked.py), named after this engine's agent."""
        transfer = self.config.kv_transfer
        if transfer is None or not transfer.may_transfer:
            return None  # (no key: start_kv_connector starts none either, and says so)
        from kvferry.kvtransfer.ranked import RankAgentSpec
        from kvferry.kvtransfer.worker import new_agent_name

        self._transfer_agent_name = new_agent_name(transfer)
        num_groups = 2 if self.arch.is_encoder_decoder else 1
        return [RankAgentSpec.for_rank(transfer, self._transfer_agent_name, rank, num_groups)
                for rank in range(len(pipeline.workers))]

    def _transfer_caches(self) -> Any:
        """What the transfer layer registers: the cache tensor of each block group it moves
        (self-attention, and for encoder-decoder models cross-attention, whose blocks share
        the one pool); or, for a pipeline, its workers' agents, which registered theirs."""
        if self.runner is None:
            from kvferry.engine.executor.pipeline import PipelineExecutor
            from kvferry.kvtransfer.ranked import RankedBackend

            assert isinstance(self.executor, PipelineExecutor)
            if self._transfer_agent_name is None:
                return None  # no agents started: the connector starts none
            return RankedBackend(self._transfer_agent_name, *self.executor.transfer_agents())
        kv_cache = self.runner.kv_cache
        return (kv_cache, kv_cache) if self.arch.is_encoder_decoder else kv_cache

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues one sequence; ValueError if it could never be scheduled or is a duplicate."""
        if self.scheduler.has_request(request.req_id):
            raise ValueError(f"request id {request.req_id!r} is already in use")
        prompt_token_ids, prompt_embeds = self._prompt_of(request)
        self.info.limits.check_params(request.sampling_params)
        encoder, cache_salt = request.encoder, request.cache_salt
        self.info.limits.check_encoder(encoder)
        encoder_key = None if encoder is None else encoder.key()
        if encoder_key is not None:
            # Decoder KV depends on the encoder's output: blocks are shared only under the
            # same encoder input.
            cache_salt = encoder_key if cache_salt is None else combine_salts(cache_salt,
                                                                              encoder_key)
        if request.encode_only and encoder is None:
            raise ValueError("encode_only needs an encoder input")
        self.scheduler.add_request(Request(
            request_id=request.req_id,
            prompt_token_ids=prompt_token_ids,
            prompt_embeds=prompt_embeds,
            sampling_params=request.sampling_params,
            eos_token_ids=tuple(request.eos_token_ids),
            priority=request.priority,
            arrival_time=request.arrival_time,
            cache_salt=cache_salt,
            kv_transfer_params=request.kv_transfer_params,
            encoder=encoder,
            encoder_key=encoder_key,
            encode_only=request.encode_only,
        ))

    def _prompt_of(self, request: EngineCoreRequest) -> tuple[list[int], torch.Tensor | None]:
        """The prompt's token ids (placeholders for a prompt of embeddings) and embeddings;
        ValueError when the request could never run."""
        embeds = request.prompt_embeds
        if embeds is None:
            self.info.limits.check_prompt(request.prompt_token_ids)
            return request.prompt_token_ids, None
        self.info.limits.check_prompt_embeds(embeds.num_tokens, embeds.hidden_size)
        if request.prompt_token_ids:
            raise ValueError("a request carries prompt token ids or prompt embeddings, not both")
        if embeds.dtype != self.info.dtype:
            raise ValueError(f"prompt embeddings of dtype {embeds.dtype}; the model runs in "
                             f"{self.info.dtype}")
        if request.cache_salt is None:
            # Without their hash every prompt of embeddings of one length would share blocks.
            raise ValueError("a request with prompt embeddings needs their hash as cache_salt")
        if request.sampling_params.prompt_logprobs is not None:
            raise ValueError("prompt logprobs need prompt token ids; the prompt is embeddings")
        tensor = embeds.to_tensor()
        return [PLACEHOLDER_TOKEN_ID] * embeds.num_tokens, tensor

    def abort_requests(
        self, req_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Finishes sequences wherever they are (the front end found a stop string, or the
        client went away); their blocks are freed at once. Unknown ids are ignored."""
        self.scheduler.finish_requests(req_ids, status)
        self._release_finished_embeds()

    def _release_finished_embeds(self) -> None:
        """The runner hears of finished requests with the next step, which may be long in
        coming on an idle engine: their prompt embeddings are let go now."""
        if self.scheduler.finished_req_ids:
            self.executor.release_prompt_embeds(self.scheduler.finished_req_ids)

    @property
    def fatal_error(self) -> Exception | None:
        """Why no further step can run (a pipeline stage is gone), or None. Steps still
        run meanwhile: each fails its requests at once."""
        return self.executor.fatal_error

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self._in_flight is not None
                or bool(self._microbatches))

    def has_requests_to_compute(self) -> bool:
        """False while the only work is transfers (pulls in flight, blocks held for one)."""
        return (self.scheduler.has_requests_to_compute() or self._in_flight is not None
                or bool(self._microbatches))

    # ------------------------------------------------------------------ step
    def step(self) -> EngineCoreOutputs:
        """Schedules, executes and updates one step; returns what it produced (with async
        scheduling: launches one step and returns what the previous one produced)."""
        if self.config.scheduler.max_concurrent_batches > 1:
            return self._step_microbatches()
        if self.scheduler.in_flight is not None:
            return self._step_overlapped()
        outputs = self._collect_transfers()
        outputs += self._admit_compiled_grammars()
        scheduler_output = self.scheduler.schedule()
        if self.kv_connector is not None:
            # Pulls planned by this schedule, cancels of requests finished since the last.
            self.kv_connector.start_transfers()
        queue_times = self._queue_times(scheduler_output)
        # Filled on a worker thread while the model runs; None in a step without grammars.
        bitmask = None
        if scheduler_output.grammar_req_ids:
            bitmask = self.structured_output.start_bitmask(scheduler_output.grammar_req_ids)
        try:
            runner_output = self.executor.submit(scheduler_output, bitmask).result()
        except Exception as exc:  # noqa: BLE001 - one bad step must not take every request down
            outputs += self._fail_step(scheduler_output, exc)
        else:
            outputs += self.scheduler.update_from_output(scheduler_output, runner_output)
        self._release_finished_embeds()
        return EngineCoreOutputs(outputs, self.make_stats(), queue_times)

    def _step_overlapped(self) -> EngineCoreOutputs:
        """Async scheduling: schedules and launches step N+1, then waits for step N and
        applies its tokens (see the module docstring)."""
        outputs = self._collect_transfers()
        outputs += self._admit_compiled_grammars()
        scheduler_output = self.scheduler.schedule()
        if self.kv_connector is not None:
            self.kv_connector.start_transfers()
        queue_times = self._queue_times(scheduler_output)
        previous, self._in_flight = self._in_flight, None
        try:
            forward = self.runner.forward_async(scheduler_output)
            if previous is not None and (
                not scheduler_output.total_num_scheduled_tokens
                or scheduler_output.grammar_req_ids or forward.reads_host_outputs
            ):
                # Sampling needs the previous step's tokens on the host: read them back
                # while the device runs this step's forward pass.
                finished, previous = previous, None
                outputs += self._finish_step(*finished)
            bitmask = self._start_bitmask(scheduler_output)
            launched = self.runner.sample_async(forward, bitmask)
        except Exception as exc:  # noqa: BLE001 - one bad step must not take every request down
            if previous is not None:
                outputs += self._finish_step(*previous)
            outputs += self._fail_step(scheduler_output, exc)
        else:
            if previous is not None:
                outputs += self._finish_step(*previous)
            if scheduler_output.total_num_scheduled_tokens:
                self._in_flight = (scheduler_output, launched)
            else:  # nothing to wait for (an encoder-only step, or none at all)
                outputs += self._finish_step(scheduler_output, launched)
        self._release_finished_embeds()
        return EngineCoreOutputs(outputs, self.make_stats(), queue_times)

    def _step_microbatches(self) -> EngineCoreOutputs:
        """Up to `max_concurrent_batches` microbatches in flight (seed 001's two-stage loop):
        schedules and submits microbatches while there is room and something to compute,
        then waits for the oldest and applies its tokens. A request whose token is in
        flight is in no other microbatch (core/scheduler.py); with an in-process executor
        each submit runs at once and this is the synchronous loop."""
        outputs = self._collect_transfers()
        outputs += self._admit_compiled_grammars()
        queue_times: dict[str, float] = {}
        # An executor that computes at submit gains nothing from more than one in flight
        # (each decode would only wait longer for its token).
        limit = min(self.config.scheduler.max_concurrent_batches,
                    self.executor.max_concurrent_batches)
        while len(self._microbatches) < limit:
            scheduler_output = self.scheduler.schedule()
            if self.kv_connector is not None:
                self.kv_connector.start_transfers()
            queue_times.update(self._queue_times(scheduler_output))
            future: Future[ModelRunnerOutput]
            try:
                future = self.executor.submit(scheduler_output,
                                              self._start_bitmask(scheduler_output))
            except Exception as exc:  # noqa: BLE001 - as a step that raises when it runs
                future = Future()
                future.set_exception(exc)
            if future.done() and future.exception() is not None:
                # Failed at submit (it could not be sent): it fails now, before a microbatch
                # behind it carries its prompts on to stages that never saw them.
                outputs += self._finish_microbatch(scheduler_output, future)
                break
            if not scheduler_output.total_num_scheduled_tokens:
                # Nothing to compute (it tells the runner who finished, or runs encoders
                # only): an executor completes it at once; nothing more to schedule until
                # a microbatch comes back.
                outputs += self._finish_microbatch(scheduler_output, future)
                break
            self._microbatches.append((scheduler_output, future))
        if self._microbatches:
            outputs += self._finish_microbatch(*self._microbatches.popleft())
        self._release_finished_embeds()
        return EngineCoreOutputs(outputs, self.make_stats(), queue_times)

    def _finish_microbatch(self, scheduler_output: SchedulerOutput,
                           future: Future[ModelRunnerOutput]) -> list[EngineCoreOutput]:
        """Waits for a microbatch's tokens and applies them."""
        try:
            runner_output = future.result()
        except Exception as exc:  # noqa: BLE001 - one bad microbatch must not take every request down
            return self._fail_step(scheduler_output, exc)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _start_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        """The step's grammar bitmask, filled on a worker thread while the model runs; None
        in a step without grammars. The previous step was updated first: a request its
        token ended is left out (its row's token is dropped)."""
        req_ids = scheduler_output.grammar_req_ids
        if not req_ids:
            return None
        structured = self.structured_output
        req_ids = [r for r in req_ids if r in structured.requests]
        return structured.start_bitmask(req_ids) if req_ids else None

    def _finish_step(self, scheduler_output: SchedulerOutput,
                     launched: AsyncModelRunnerOutput) -> list[EngineCoreOutput]:
        """Waits for a launched step's tokens and applies them."""
        try:
            runner_output = launched.result()
        except Exception as exc:  # noqa: BLE001 - as a step that raises when it runs
            return self._fail_step(scheduler_output, exc)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _admit_compiled_grammars(self) -> list[EngineCoreOutput]:
        """Queues requests whose grammar compiled; with nothing else to compute, first waits
        a little for a compile rather than returning to spin."""
        scheduler = self.scheduler
        if not scheduler.waiting_for_grammar:
            return []
        if not scheduler.has_requests_to_compute():
            self.structured_output.wait_for_compiles(GRAMMAR_WAIT_S)
        return scheduler.admit_compiled_grammars()

    def _collect_transfers(self) -> list[EngineCoreOutput]:
        if self.kv_connector is None:
            return []
        return self.scheduler.update_from_kv_connector(self.kv_connector.worker.get_finished())

    def make_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        stats.num_microbatches_in_flight = len(self._microbatches)
        stats.stage_busy_seconds = self.executor.stage_busy_seconds()
        if self.kv_connector is not None:
            stats.kv_transfer = self.kv_connector.stats()
        return stats

    def shutdown(self) -> None:
        """Stops the KV connector's threads, side channel and (a pipeline's) rank agents, the
        executor, and the grammar threads."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        self.executor.shutdown()
        self.structured_output.shutdown()

    def _queue_times(self, scheduler_output: SchedulerOutput) -> dict[str, float]:
        """Seconds each sequence first scheduled this step waited since its arrival.

        Arrival times are on the front end's `time.monotonic()` clock, which is system-wide,
        so the difference holds when the core runs in another process.
        """
        new_reqs = scheduler_output.scheduled_new_reqs
        if not new_reqs:
            return {}
        now = time.monotonic()
        requests = self.scheduler.requests
        return {
            r.req_id: max(now - requests[r.req_id].arrival_time, 0.0)
            for r in new_reqs if not r.is_resumed
        }

    def _fail_step(self, scheduler_output: SchedulerOutput,
                   exc: BaseException) -> list[EngineCoreOutput]:
        failed = self.scheduler.fail_step(scheduler_output)
        failed_ids = [r.request_id for r in failed]
        logger.error(
            "a step of %d requests failed; they end with finish_reason 'error', the engine "
            "goes on: %s", len(failed_ids), failed_ids, exc_info=exc,
        )
        self.executor.recover_from_failed_step(failed_ids)
        return [EngineCoreOutput(r, [], finish_reason=FinishReason.ERROR) for r in failed_ids]


def check_kv_cache_fits(
    num_blocks: int, cache: CacheConfig, max_model_len: int, device: torch.device,
    max_encoder_len: int = 0,
) -> None:
    """Raises ValueError unless the pool holds one sequence of `max_model_len` tokens (and,
    for an encoder-decoder model, the cross-attention blocks of the longest encoder input).

    Otherwise a request that grows to that length could never be scheduled and would
    wait forever.
    """
    capacity = (num_blocks - 1) * cache.block_size  # block 0 is the null block
    cross = -(-max_encoder_len // cache.block_size) * cache.block_size
    if capacity >= max_model_len + cross:
        return
    if cache.num_gpu_blocks_override is not None:
        setting = "num_gpu_blocks_override (--num-gpu-blocks-override)"
    elif device.type == "cuda":
        setting = "gpu_memory_utilization (--gpu-memory-utilization)"
    else:
        setting = "kv_cache_memory_bytes (--kv-cache-memory-bytes)"
    needed = (f"max_model_len={max_model_len}" if not cross else
              f"max_model_len={max_model_len} plus {cross} slots of cross-attention KV")
    raise ValueError(
        f"the KV cache pool has {num_blocks - 1} blocks of {cache.block_size} tokens "
        f"({capacity} tokens), fewer than {needed}: a sequence of the "
        f"maximum length could never be scheduled. Raise {setting} or lower max_model_len "
        "(--max-model-len)"
    )


def resolve_encoder_budget(sched: SchedulerConfig, arch: ModelArchConfig) -> int:
    """Fills in the scheduler's encoder budget and returns the longest encoder input the
    engine takes (0 for a decoder-only model); ValueError when the budget cannot hold the
    input every audio request has."""
    if not arch.is_encoder_decoder:
        return 0
    longest = arch.max_encoder_positions
    if sched.max_num_encoder_tokens is None:
        sched.max_num_encoder_tokens = max(sched.max_num_batched_tokens, longest)
    if arch.encoder_input == "audio" and sched.max_num_encoder_tokens < longest:
        raise ValueError(
            f"max_num_encoder_tokens={sched.max_num_encoder_tokens} is smaller than the "
            f"{longest} encoder positions of every audio input of this model: raise it "
            "(--max-num-encoder-tokens)")
    return min(longest, sched.max_num_encoder_tokens)


def combine_salts(first: bytes, second: bytes) -> bytes:
    """One prefix-cache salt from two (a prompt's and an encoder input's)."""
    return hashlib.sha256(first + b"|" + second).digest()


def resolve_max_model_len(requested: int | None, arch: ModelArchConfig) -> int:
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len {requested} is larger than the model's "
            f"max_position_embeddings of {limit}"
        )
    return requested


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {name!r}")
    return torch.device(name)
