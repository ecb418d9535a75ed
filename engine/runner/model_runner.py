"""Runs one scheduled step: update the persistent batch, prepare inputs, forward, sample."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from kvferry.engine.attention import (
    AttentionMetadata,
    AttentionType,
    KVCacheView,
    get_attention_backend,
)
from kvferry.engine.config import CacheConfig
from kvferry.engine.core.scheduler_output import (
    CachedRequestData,
    EncoderWork,
    ModelRunnerOutput,
    SchedulerOutput,
)
from kvferry.engine.executor.partition import PipelineStage
from kvferry.engine.layers.tensor_parallel import TensorParallel, shard_heads
from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.models.encoder_decoder import EncoderBatch
from kvferry.engine.models.loader import load_model
from kvferry.engine.runner.async_output import (
    AsyncModelRunnerOutput,
    ForwardPass,
    HostLogprobs,
    PendingTokens,
    logprobs_lists,
    pack_for_host,
    unpack_on_host,
)
from kvferry.engine.runner.cpu_malloc import keep_activation_memory
from kvferry.engine.runner.cuda_graphs import DecodeGraphs, capture_sizes, is_decode_only
from kvferry.engine.runner.input_batch import CachedRequestState, InputBatch
from kvferry.engine.runner.memory_profile import EncoderProfile, measure_gpu_kv_cache_budget
from kvferry.engine.runner.prepare_inputs import InputBuffers, PreparedInputs, prepare_inputs
from kvferry.engine.runner.step_staging import StepStaging, StepTensors
from kvferry.engine.sample.metadata import SamplingMetadata
from kvferry.engine.sample.sampler import Sampler, SamplerOutput
from kvferry.engine.sample.uploads import PinnedUploads
from kvferry.kvtransfer.memory import allocate_kv_cache

if TYPE_CHECKING:
    from kvferry.engine.structured_output.manager import GrammarBitmask

logger = logging.getLogger(__name__)

_req_id = attrgetter("req_id")

# Default KV cache budget on CPU when none is configured.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def kv_cache_block_bytes(arch: ModelArchConfig, block_size: int, dtype: torch.dtype,
                         num_layers: int | None = None, num_kv_heads: int | None = None) -> int:
    """Bytes of one block: every layer's keys and values for `block_size` tokens (of
    `num_layers` layers, a pipeline stage's; of `num_kv_heads`, a tensor-parallel rank's;
    default all of them)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    layers = arch.num_layers if num_layers is None else num_layers
    heads = arch.num_kv_heads if num_kv_heads is None else num_kv_heads
    return layers * 2 * block_size * heads * arch.head_size * element_size


def determine_num_blocks(
    arch: ModelArchConfig, cache: CacheConfig, dtype: torch.dtype, gpu_budget: int | None
) -> int:
    """Blocks (the null block included) that fit the memory budget: `gpu_budget` bytes (what
    profiling left on a GPU), else the configured CPU budget."""
    return num_blocks_in_budget(kv_cache_block_bytes(arch, cache.block_size, dtype), cache,
                                gpu_budget)


def num_blocks_in_budget(block_bytes: int, cache: CacheConfig, gpu_budget: int | None) -> int:
    """Blocks of `block_bytes` each (the null block included) in `gpu_budget` bytes, else in
    the configured CPU budget; `num_gpu_blocks_override` when set."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if gpu_budget is not None:
        budget = gpu_budget
    else:
        budget = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = max(0, budget) // block_bytes
    if num_blocks < 2:
        raise ValueError(
            f"the KV cache budget of {budget} bytes holds {num_blocks} blocks of "
            f"{cache.block_size} tokens; at least 2 are needed: raise kv_cache_memory_bytes "
            "or gpu_memory_utilization"
        )
    return int(num_blocks)


class ModelRunner:
    """Owns the model, the KV cache tensor and the persistent input batch."""

    def __init__(
        self,
        model_dir: Path,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        device: torch.device,
        cache: CacheConfig,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        attention_backend: str = "auto",
        transfer_memory: bool = False,
        stage: PipelineStage | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        self.arch = arch
        # The pipeline stage this runner computes (pipeline parallelism, stage_runner.py);
        # None: the whole model. The KV cache holds the stage's layers only.
        self.stage = stage
        self.num_layers = arch.num_layers if stage is None else stage.num_layers
        # This process's tensor-parallel rank: its model holds its shard of every layer,
        # its KV cache its kv heads only.
        self.tp = tp or TensorParallel()
        heads = None if self.tp.size == 1 else shard_heads(arch.num_heads, arch.num_kv_heads,
                                                            self.tp)
        self.num_kv_heads = arch.num_kv_heads if heads is None else heads.num_kv_heads
        # The first of the model's kv heads this rank's cache holds.
        self.first_kv_head = 0 if heads is None else heads.first_kv_head
        # The cache is registered with NIXL: allocate it where pulls read it fast.
        self._transfer_memory = transfer_memory
        self.device = device
        self.block_size = cache.block_size
        if device.type == "cpu":
            keep_activation_memory()
        self.attn_backend = get_attention_backend(attention_backend, device)
        self.model = load_model(model_dir, dtype, self.attn_backend, device, stage, tp)
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        # Allocated by `initialize_kv_cache`, once its size is known.
        self.kv_cache = torch.empty(0, dtype=dtype, device=device)
        self.kv_caches: list[KVCacheView] = []
        # Encoder-decoder models: rows carry cross block tables as long as the longest input.
        self.is_encoder_decoder = arch.is_encoder_decoder
        self.input_batch = InputBatch(max_num_reqs, max_model_len, cache.block_size, device,
                                      arch.max_encoder_positions if arch.is_encoder_decoder
                                      else 0)
        self.buffers = InputBuffers.allocate(max_num_batched_tokens, max_num_reqs)
        self.staging = StepStaging(max_num_batched_tokens, max_num_reqs, device)
        self.sampler = Sampler()
        # Pinned host buffers of the sampling metadata's one copy per dtype (a GPU).
        self._sampling_uploads = PinnedUploads() if device.type == "cuda" else None
        # Decode-only steps through CUDA graphs (cuda_graphs.py); None: every step eager.
        self.graphs: DecodeGraphs | None = None
        # Async scheduling: sampled tokens still on the device (async_output.py).
        self.pending = PendingTokens(self.input_batch)
        # Every request the runner knows, in the batch or not (unscheduled this step).
        self.requests: dict[str, CachedRequestState] = {}
        # Requests whose prompt logprobs are still to be computed (prompt_logprobs asked,
        # prefill not done): the only ones a step scores its prompt positions for.
        self._scoring_prompts: set[str] = set()
        # Pinned host rows of prompt embeddings for one step's copy (a GPU; made on first
        # use), and the event after the last copy from them (refilled only once it is done).
        self._embeds_staging: torch.Tensor | None = None
        self._embeds_copied: torch.cuda.Event | None = None

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        # Blocks outermost, so one block is one contiguous region across all layers.
        arch = self.arch
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads,
                arch.head_size)

    def measure_kv_cache_budget(self, utilization: float, max_num_seqs: int,
                                max_num_encoder_tokens: int = 0,
                                decode_graphs: bool = False) -> int | None:
        """On a GPU, the KV cache budget in bytes after a profiling step of the largest
        size (memory_profile.py), less what the decode graphs will hold when
        `decode_graphs`; None on CPU, where the budget is configured."""
        if self.device.type != "cuda":
            return None
        return measure_gpu_kv_cache_budget(
            self.model, self.arch.vocab_size, self.max_num_batched_tokens, max_num_seqs,
            self.max_model_len, self.block_size, self.kv_cache_shape(1), self.dtype,
            self.device, utilization, self.encoder_profile(max_num_encoder_tokens),
            graph_rows=self.decode_graph_sizes[-1] if decode_graphs else 0,
        )

    def encoder_profile(self, max_num_encoder_tokens: int) -> EncoderProfile | None:
        """The largest encoder pass a step can run (None for a decoder-only model)."""
        arch = self.arch
        if not arch.is_encoder_decoder:
            return None
        return EncoderProfile(max(max_num_encoder_tokens, arch.max_encoder_positions),
                              arch.max_encoder_positions, arch.encoder_input,
                              arch.num_mel_bins)

    def initialize_kv_cache(self, num_blocks: int, for_transfer: bool = False) -> None:
        """Allocates the cache; `for_transfer`: it is registered for KV transfers (as with
        `transfer_memory`)."""
        self._transfer_memory = self._transfer_memory or for_transfer
        self.kv_cache, self.kv_caches = self._allocate_kv_cache(num_blocks, self.dtype)

    @property
    def decode_graph_sizes(self) -> list[int]:
        """The batch sizes of decode-only steps `enable_decode_graphs` captures."""
        return capture_sizes(self.input_batch.max_num_reqs, self.max_num_batched_tokens)

    def enable_decode_graphs(self) -> None:
        """From now on decode-only steps run through `DecodeGraphs`: captured here on a GPU
        (the KV cache must be allocated: the graphs hold its address), run eagerly over the
        same padded buffers on the CPU (what the CPU tests check)."""
        if self.is_encoder_decoder:
            raise ValueError("decode graphs do not cover cross-attention (encoder-decoder "
                             "models run eagerly)")
        if self.device.type == "cuda" and self.attn_backend.name != "triton":
            raise ValueError(f"CUDA graphs need the triton attention backend; "
                             f"{self.attn_backend.name} plans each step on the host")
        graphs = DecodeGraphs(self.decode_graph_sizes, self.input_batch.block_table.device,
                              self.max_model_len, self.device)
        graphs.bind(self.model, self.model.compute_logits, self.kv_caches)
        if self.device.type == "cuda":
            graphs.capture()
        self.graphs = graphs

    def _allocate_kv_cache(
        self, num_blocks: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, list[KVCacheView]]:
        shape = self.kv_cache_shape(num_blocks)
        if self._transfer_memory:
            kv_cache = allocate_kv_cache(shape, dtype, self.device)
        else:
            kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        views = [(kv_cache[:, i, 0], kv_cache[:, i, 1]) for i in range(self.num_layers)]
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB), shape %s",
            num_blocks, self.block_size, kv_cache.numel() * kv_cache.element_size() / 2**20,
            tuple(shape),
        )
        return kv_cache, views

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar_bitmask: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Runs the step; `grammar_bitmask` (being filled on another thread while the model
        runs) constrains the rows of requests under a grammar."""
        forward = self._forward(scheduler_output, deferred=False)
        if forward.logits is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[],
                                     prompt_logprobs=forward.prompt_logprobs)
        output = self._record_samples(forward.rows, forward.states,
                                      self._sample(forward, grammar_bitmask))
        output.prompt_logprobs = forward.prompt_logprobs
        return output

    def execute_model_async(self, scheduler_output: SchedulerOutput,
                            grammar_bitmask: GrammarBitmask | None = None
                            ) -> AsyncModelRunnerOutput:
        """`execute_model` for async scheduling: the sampled tokens stay on the device (the
        next step's inputs are filled from there) and `result()` reads them on the host
        (async_output.py). On a GPU it does not wait for the step's results (only for
        what a copy from pageable memory waits for: the work queued before it)."""
        return self.sample_async(self.forward_async(scheduler_output), grammar_bitmask)

    @torch.inference_mode()
    def forward_async(self, scheduler_output: SchedulerOutput) -> ForwardPass:
        """The first half of `execute_model_async`: the batch updated, its inputs filled
        from the steps in flight, the model run up to the logits. Nothing here needs the
        previous step's tokens on the host, so it may be queued before they are read."""
        return self._forward(scheduler_output, deferred=True)

    @torch.inference_mode()
    def sample_async(self, forward: ForwardPass,
                     grammar_bitmask: GrammarBitmask | None = None) -> AsyncModelRunnerOutput:
        """The second half: samples the forward pass's rows and leaves the tokens on the
        device. Rows with penalties count the outputs' values on the host: with tokens of
        a step still pending, it waits for them first (the engine core reads the previous
        step back before this when `forward.reads_host_outputs`)."""
        if forward.logits is None:
            return AsyncModelRunnerOutput.ready(ModelRunnerOutput(
                req_ids=[], sampled_token_ids=[], prompt_logprobs=forward.prompt_logprobs))
        if self.pending and forward.reads_host_outputs:
            self.pending.resolve_all()
        return self.pending.defer(forward.states, forward.rows,
                                  self._sample(forward, grammar_bitmask),
                                  forward.prompt_logprobs)

    def _forward(self, scheduler_output: SchedulerOutput, deferred: bool) -> ForwardPass:
        """Updates the batch and runs the model up to the logits of the rows that sample.

        `deferred`: the batch may hold tokens still on the device (async scheduling)."""
        self._update_states(scheduler_output)
        if scheduler_output.scheduled_encoder_inputs:
            self._run_encoder(scheduler_output.scheduled_encoder_inputs)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ForwardPass(scheduler_output)
        batch = self.input_batch
        req_ids = batch.active_req_ids
        num_scheduled = np.fromiter(
            (scheduler_output.num_scheduled_tokens[r] for r in req_ids), np.int64, len(req_ids)
        )
        prepared = prepare_inputs(
            num_scheduled, batch.num_computed_tokens, batch.num_tokens, batch.token_ids.np,
            batch.block_table.np, self.block_size, self.buffers,
        )
        graph_size = self._graph_size(prepared)
        if graph_size is not None:
            return self._forward_graph(scheduler_output, prepared, graph_size, deferred)
        # One host-to-device copy of the step's index arrays (the block table is the other).
        staged = self.staging.stage(prepared)
        if deferred:
            # A decode's input is the token its previous step sampled, on the device still.
            self.pending.fill_inputs(staged.input_ids, prepared.input_ids,
                                     prepared.query_start_loc)
        metadata = self._attention_metadata(prepared, staged)
        hidden = self._run_model(staged, prepared, num_scheduled, metadata)
        if hidden is None:  # a pipeline stage before the last: the next stage samples
            return ForwardPass(scheduler_output)
        forward = ForwardPass(scheduler_output,
                              prompt_logprobs=self._prompt_logprobs(hidden, prepared,
                                                                    num_scheduled))
        forward.rows = prepared.sampled_rows.tolist()
        if forward.rows:  # else every request is mid-prefill
            forward.logits = self.model.compute_logits(hidden[staged.logits_indices])
            forward.states = list(map(batch.states.__getitem__, forward.rows))
        return forward

    def _run_model(self, staged: StepTensors, prepared: PreparedInputs,
                   num_scheduled: np.ndarray, metadata: AttentionMetadata) -> torch.Tensor | None:
        """The model over the step's tokens: hidden states (num_tokens, hidden_size), or
        None where another pipeline stage goes on from here (stage_runner.py)."""
        embeds_rows = self.input_batch.prompt_embeds_rows(len(num_scheduled))
        if embeds_rows.size:
            inputs_embeds = self._inputs_embeds(staged.input_ids, prepared, num_scheduled,
                                                embeds_rows)
            return self.model(None, staged.positions, self.kv_caches, metadata, inputs_embeds)
        # The plain token path, unchanged for steps without a prompt of embeddings.
        return self.model(staged.input_ids, staged.positions, self.kv_caches, metadata)

    def _graph_size(self, prepared: PreparedInputs) -> int | None:
        """The graph a step replays: its padded size, or None to run it eagerly (no graphs,
        a prefill among its rows, a prompt of embeddings, prompt logprobs, too many rows)."""
        if self.graphs is None or self._scoring_prompts or not is_decode_only(prepared):
            return None
        num_reqs = prepared.seq_lens.shape[0]
        if self.input_batch.prompt_embeds_rows(num_reqs).size:
            return None
        return self.graphs.padded_size(num_reqs)

    def _forward_graph(self, scheduler_output: SchedulerOutput, prepared: PreparedInputs,
                       size: int, deferred: bool) -> ForwardPass:
        """A decode-only step through the graph of `size` rows (see cuda_graphs.py)."""
        assert self.graphs is not None
        num_reqs = prepared.seq_lens.shape[0]
        inputs = self.graphs.stage(prepared, size)
        if deferred:
            self.pending.fill_inputs(inputs.input_ids, prepared.input_ids,
                                     prepared.query_start_loc)
        self.input_batch.block_table.copy_to_device(num_reqs)
        forward = ForwardPass(scheduler_output)
        forward.rows = list(range(num_reqs))
        forward.states = list(map(self.input_batch.states.__getitem__, forward.rows))
        forward.logits = self.graphs.run(num_reqs, size)
        return forward

    def _sample(self, forward: ForwardPass,
                grammar_bitmask: GrammarBitmask | None) -> SamplerOutput:
        assert forward.logits is not None
        metadata = self._sampling_metadata(forward.states, forward.scheduler_output,
                                           grammar_bitmask)
        return self.sampler(forward.logits, metadata)

    def _run_encoder(self, works: list[EncoderWork]) -> None:
        """Runs the encoder over the inputs of the step's new encoder-decoder requests, as
        one flat batch, and writes each decoder layer's cross-attention keys and values
        into the requests' cross blocks (position p of a request goes to slot
        `cross_block_ids[p // block_size] * block_size + p % block_size`)."""
        device, block_size = self.device, self.block_size
        lengths = np.fromiter((w.encoder.num_positions for w in works), np.int32, len(works))
        starts = np.zeros(len(works) + 1, dtype=np.int32)
        np.cumsum(lengths, out=starts[1:])
        total = int(starts[-1])
        metadata = AttentionMetadata(
            num_reqs=len(works), num_actual_tokens=total, max_query_len=int(lengths.max()),
            max_seq_len=int(lengths.max()),
            query_start_loc=torch.from_numpy(starts).to(device),
            seq_lens=torch.from_numpy(lengths).to(device),
            block_table=torch.zeros((len(works), 0), dtype=torch.int32, device=device),
            slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
            query_start_loc_np=starts, seq_lens_np=lengths, attn_type=AttentionType.ENCODER,
        )
        positions = np.arange(total, dtype=np.int64) - np.repeat(starts[:-1], lengths)
        if works[0].encoder.is_audio:
            features = torch.stack([w.encoder.features_tensor() for w in works])
            batch = EncoderBatch(metadata, input_features=features.to(device, self.dtype))
        else:
            ids = np.fromiter((t for w in works for t in w.encoder.token_ids), np.int64, total)
            batch = EncoderBatch(metadata, input_ids=torch.from_numpy(ids).to(device),
                                 positions=torch.from_numpy(positions).to(device))
        hidden = self.model.encode(batch)  # (total, hidden_size)
        tables = [np.asarray(w.cross_block_ids, dtype=np.int64) for w in works]
        blocks = np.concatenate([table[np.arange(n) // block_size]
                                 for table, n in zip(tables, lengths.tolist())])
        slots = blocks * block_size + positions % block_size
        self.model.write_cross_kv(hidden, self.kv_caches, torch.from_numpy(slots).to(device))

    def _inputs_embeds(
        self, input_ids: torch.Tensor, prepared: PreparedInputs, num_scheduled: np.ndarray,
        rows: np.ndarray,
    ) -> torch.Tensor:
        """The step's inputs as embeddings: every token looked up in the embedding table,
        then the prompt positions of `rows` (prompts given as embeddings) overwritten with
        their rows of the request's tensor.

        Worked example: two rows, row 0 a prompt of 5 embeddings with 2 computed and 4
        scheduled, row 1 a token prompt with 3 scheduled: query_start_loc = [0, 4, 7]; row 0
        copies its embeddings [2, 5) into tokens [0, 3); token 3 (its first output token)
        and tokens [4, 7) keep their table lookups.
        """
        batch = self.input_batch
        embeds = self.model.get_input_embeddings(input_ids)  # (num_tokens, hidden_size)
        starts = batch.num_computed_tokens[rows].astype(np.int64)
        ends = np.minimum(starts + num_scheduled[rows], batch.num_prompt_tokens[rows])
        firsts = prepared.query_start_loc[rows]
        pieces = [batch.states[row].prompt_embeds[start:end]  # type: ignore[union-attr]
                  for row, start, end in zip(rows.tolist(), starts.tolist(), ends.tolist())]
        source = self._embeds_on_device(pieces)
        offset = 0
        for first, count in zip(firsts.tolist(), (ends - starts).tolist()):
            embeds[first:first + count] = source[offset:offset + count]
            offset += count
        return embeds

    def _embeds_on_device(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The rows of `pieces` back to back on the device: on a GPU, packed into a pinned
        staging buffer and moved with one copy."""
        if self.device.type == "cpu":
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        num_rows = sum(piece.shape[0] for piece in pieces)
        staging = self._embeds_staging
        if staging is None or staging.shape[0] < num_rows:
            staging = torch.empty((max(num_rows, self.max_num_batched_tokens),
                                   self.arch.hidden_size), dtype=self.dtype,
                                  pin_memory=torch.cuda.is_available())
            self._embeds_staging = staging
        if self._embeds_copied is not None:
            self._embeds_copied.synchronize()  # async scheduling: a step may be queued still
        torch.cat(pieces, out=staging[:num_rows])
        # Non-blocking from pinned memory, like the index arrays (step_staging.py).
        on_device = staging[:num_rows].to(self.device, non_blocking=True)
        self._embeds_copied = torch.cuda.Event()
        self._embeds_copied.record()
        return on_device

    def _prompt_logprobs(
        self, hidden: torch.Tensor, prepared: PreparedInputs, num_scheduled: np.ndarray
    ) -> dict[str, tuple[int, list[list[tuple[int, float, int]]]]]:
        """Prompt logprobs of the rows that asked for them and computed prompt tokens.

        The hidden state at position p gives the distribution of token p + 1, so a chunk of
        positions [c, c + n) scores prompt positions c + 1 .. min(c + n, P - 1) (the last
        position's distribution is the first output token's, which the sampler scores).
        """
        batch = self.input_batch
        result: dict[str, tuple[int, list[list[tuple[int, float, int]]]]] = {}
        for req_id in list(self._scoring_prompts):
            row = batch.req_id_to_index.get(req_id)
            if row is None or row >= len(num_scheduled):
                continue  # not scheduled this step
            state = batch.states[row]
            assert state is not None
            k = state.sampling_params.prompt_logprobs
            assert k is not None
            start = int(batch.num_computed_tokens[row])
            num_prompt = len(state.prompt_token_ids)
            end = start + int(num_scheduled[row])
            if end >= num_prompt - 1:
                self._scoring_prompts.discard(req_id)  # this chunk scores the last of them
            count = min(end, num_prompt - 1) - start
            if count <= 0:
                continue
            first = int(prepared.query_start_loc[row])
            targets = state.prompt_token_ids[start + 1:start + 1 + count]
            entries = score_positions(self.model, hidden[first:first + count], targets, k)
            result[state.req_id] = (start + 1, entries)
        return result

    def _update_states(self, so: SchedulerOutput) -> None:
        """Applies the scheduler's diff to the persistent batch."""
        batch = self.input_batch
        self._forget_requests(so.finished_req_ids)
        gone = so.finished_req_ids | so.preempted_req_ids
        for req_id in so.preempted_req_ids:
            self.requests.pop(req_id, None)
            self._scoring_prompts.discard(req_id)
        # Rows not scheduled this step leave the batch (their state is kept).
        unscheduled = set(batch.active_req_ids).difference(so.num_scheduled_tokens)
        batch.remove_requests(gone | unscheduled)
        if self.pending and so.scheduled_new_reqs:
            self.pending.note_new_requests([new.req_id for new in so.scheduled_new_reqs])
        for new in so.scheduled_new_reqs:
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.token_ids[: new.num_prompt_tokens],
                sampling_params=new.sampling_params,
                output_token_ids=new.token_ids[new.num_prompt_tokens :],
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                prompt_embeds=new.prompt_embeds,
                cross_block_ids=new.cross_block_ids,
                num_encoder_tokens=new.num_encoder_tokens,
            )
            self.requests[new.req_id] = state
            if new.sampling_params.prompt_logprobs is not None:
                self._scoring_prompts.add(new.req_id)
            batch.add_request(state)
        cached = so.scheduled_cached_reqs
        rows = list(map(batch.req_id_to_index.get, cached.req_ids))
        # New blocks of rows already in the batch; a re-added row gets its whole table.
        appended = cached.new_block_ids
        if None in rows:  # back in the batch after a step without tokens
            appended = dict(appended)
            for i, row in enumerate(rows):
                if row is None:
                    rows[i] = self._readd_request(cached.req_ids[i], cached, i)
                    appended.pop(cached.req_ids[i], None)
        for req_id, new_block_ids in appended.items():
            batch.append_block_ids(batch.req_id_to_index[req_id], new_block_ids)
        batch.num_computed_tokens[rows] = cached.num_computed_tokens

    def _readd_request(self, req_id: str, cached: CachedRequestData, i: int) -> int:
        """Rebuilds the row of a known request that sat out the previous step."""
        state = self.requests[req_id]
        state.block_ids.extend(cached.new_block_ids.get(req_id, ()))
        state.num_computed_tokens = cached.num_computed_tokens[i]
        return self.input_batch.add_request(state)

    def _forget_requests(self, req_ids: set[str]) -> None:
        """Drops everything kept for finished requests (rows are removed by the caller)."""
        for req_id in req_ids:
            self.requests.pop(req_id, None)
            self._scoring_prompts.discard(req_id)

    def release_prompt_embeds(self, req_ids: Iterable[str]) -> None:
        """Drops the embeddings held for finished requests before their rows go (the next
        step removes those); a finished row is never scheduled, so nothing reads them."""
        for req_id in req_ids:
            state = self.requests.get(req_id)
            if state is not None:
                state.prompt_embeds = None

    def recover_from_failed_step(self, failed_req_ids: list[str]) -> None:
        """Returns to a consistent state after `execute_model` raised.

        The failed step's requests are gone (the scheduler finished them); every row is
        dropped, because the step may have left rows half updated. The other requests
        keep their `CachedRequestState` and are rebuilt from it when next scheduled.
        """
        self._forget_requests(set(failed_req_ids))
        self.input_batch.remove_requests(list(self.input_batch.active_req_ids))

    @property
    def num_tracked_requests(self) -> int:
        """Requests with runner state (rows or cached states); 0 when idle."""
        return len(self.requests)

    def _attention_metadata(self, prepared: PreparedInputs, staged: StepTensors) -> AttentionMetadata:
        num_reqs = prepared.seq_lens.shape[0]
        metadata = AttentionMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=prepared.positions.shape[0],
            max_query_len=prepared.max_query_len,
            max_seq_len=prepared.max_seq_len,
            query_start_loc=staged.query_start_loc,
            seq_lens=staged.seq_lens,
            block_table=self.input_batch.block_table.copy_to_device(num_reqs),
            slot_mapping=staged.slot_mapping,
            query_start_loc_np=prepared.query_start_loc,
            seq_lens_np=prepared.seq_lens,
        )
        cross_table = self.input_batch.cross_block_table
        if cross_table is not None:
            # Every row's queries over its encoder's keys (never causal, never written).
            encoder_lens = self.input_batch.num_encoder_tokens[:num_reqs]
            metadata.cross = AttentionMetadata(
                num_reqs=num_reqs,
                num_actual_tokens=metadata.num_actual_tokens,
                max_query_len=metadata.max_query_len,
                max_seq_len=int(encoder_lens.max()),
                query_start_loc=staged.query_start_loc,
                seq_lens=torch.from_numpy(encoder_lens).to(self.device, non_blocking=True),
                block_table=cross_table.copy_to_device(num_reqs),
                slot_mapping=staged.slot_mapping,
                query_start_loc_np=prepared.query_start_loc,
                seq_lens_np=encoder_lens,
                attn_type=AttentionType.CROSS,
            )
        return metadata

    def _sampling_metadata(self, states: list[CachedRequestState], so: SchedulerOutput,
                           grammar_bitmask: GrammarBitmask | None) -> SamplingMetadata:
        blocked = {
            i: so.blocked_stop_token_ids[s.req_id]
            for i, s in enumerate(states)
            if s.req_id in so.blocked_stop_token_ids
        }
        return SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            # A prompt of embeddings has no token ids for the repetition penalty to see.
            prompt_token_ids=[s.prompt_token_ids if s.prompt_embeds is None else []
                              for s in states],
            stop_token_ids_to_block=blocked,
            vocab_size=self.arch.vocab_size,
            device=self.device,
            grammar_bitmask=(None if grammar_bitmask is None
                             else _grammar_rows(states, grammar_bitmask)),
            pinned=self._sampling_uploads,
        )

    def _record_samples(self, rows: list[int], states: list[CachedRequestState],
                        output: SamplerOutput) -> ModelRunnerOutput:
        """Writes each sampled token into its row: it is that request's next input."""
        sampled, logprobs = _copy_to_host(output)
        token_ids = sampled.tolist()
        for state, token_id in zip(states, token_ids):
            state.output_token_ids.append(token_id)
        self.input_batch.append_tokens(np.asarray(rows), sampled.numpy())
        req_ids = list(map(_req_id, states))
        return ModelRunnerOutput(req_ids, token_ids, logprobs_lists(states, logprobs))


def _grammar_rows(states: list[CachedRequestState],
                  grammar_bitmask: GrammarBitmask) -> tuple[list[int], torch.Tensor]:
    """The logits rows of the bitmask's requests in ascending order, and their bitmask rows in
    the same order (waited for here, the last moment: it was filled while the model ran).
    When every row is constrained, rows are then 0..n-1 and the sampler masks in one pass."""
    row_of = {state.req_id: row for row, state in enumerate(states)}
    rows = [row_of.get(req_id) for req_id in grammar_bitmask.req_ids]
    if None in rows:
        missing = [r for r, row in zip(grammar_bitmask.req_ids, rows) if row is None]
        raise RuntimeError(f"requests {missing} have a grammar bitmask but sample nothing")
    bitmask = grammar_bitmask.result()
    order = sorted(range(len(rows)), key=rows.__getitem__)
    if order != list(range(len(rows))):
        bitmask = bitmask[order]  # a small host gather: one row of words per request
        rows = [rows[i] for i in order]
    return rows, bitmask  # type: ignore[return-value]


# Prompt positions scored at once: their logits are (rows, vocab_size) float32.
PROMPT_LOGPROBS_ROWS = 512


def score_positions(model: torch.nn.Module, hidden: torch.Tensor, targets: list[int],
                    k: int) -> list[list[tuple[int, float, int]]]:
    """Per position: [(target, its logprob, its rank), (top-1 id, logprob, 1), ...]."""
    entries: list[list[tuple[int, float, int]]] = []
    for begin in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
        end = min(begin + PROMPT_LOGPROBS_ROWS, len(targets))
        logprobs = model.compute_logits(hidden[begin:end]).float().log_softmax(dim=-1)
        target = torch.tensor(targets[begin:end], dtype=torch.int64, device=logprobs.device)
        chosen = logprobs.gather(1, target[:, None])  # (rows, 1)
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        columns = [target[:, None].double(), chosen.double(), ranks[:, None].double()]
        if k > 0:
            top_values, top_ids = logprobs.topk(k, dim=-1)
            columns += [top_ids.double(), top_values.double()]
        host = torch.cat(columns, dim=1).cpu().tolist()  # one copy to the host
        for row in host:
            position = [(int(row[0]), row[1], int(row[2]))]
            position += [(int(row[3 + j]), row[3 + k + j], j + 1) for j in range(k)]
            entries.append(position)
    return entries


def _copy_to_host(output: SamplerOutput) -> tuple[torch.Tensor, HostLogprobs | None]:
    """The step's one device-to-host copy, which the synchronous loop waits for: the
    sampled ids, and with logprobs, ids, values and ranks packed beside them
    (async_output.pack_for_host)."""
    packed, k = pack_for_host(output)
    return unpack_on_host(packed.cpu(), k)
