"""CUDA graphs of decode-only steps.

A decode-only step (every row computes one token, no prompt embeddings, no
cross-attention) launches the same kernels in the same order whatever its contents; only
its size changes. The runner captures the model's forward pass and the logits projection
once per capture size (1, 2, 4, then every 8 up to `max_num_seqs`) over fixed input
buffers, and replays the smallest graph that holds a step: one launch instead of
thousands, so the host's Python never sits between two kernels.

Padding: a step of n rows replayed in the graph of size B >= n carries B - n padding rows,
each a one-token query with input id 0, position 0, slot -1 (the cache write skips it) and
sequence length 0 (attention reads no key for it). Their logits are computed and never
sampled: the sampler sees rows [0, n).

Worked example, M = 8 (the largest size), a step of 3 decodes at sequence lengths
[17, 5, 9] replayed in the graph of size 4:

    input_ids       = [t0, t1, t2, 0]            positions = [16, 4, 8, 0]
    slot_mapping    = [s0, s1, s2, -1]           seq_lens  = [17, 5, 9, 0]
    query_start_loc = [0, 1, 2, 3, 4]

Fixed buffers: one int64 device buffer laid out as [input_ids: M | positions: M |
slot_mapping: M | query_start_loc: M + 1 | seq_lens: M], filled from a pinned host twin
with one copy per step; the block table is the persistent batch's device table (its first
B rows). Graphs are captured with attention planned for the longest sequence
(`max_model_len`), so each size's split-KV is fixed; the kernels read the actual lengths
from `seq_lens`.

On the CPU nothing is captured: `run` computes the same padded step eagerly, which is how
the CPU tests check the padding and the buffers.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from kvferry.engine.attention import AttentionMetadata, KVCacheView
from kvferry.engine.runner.prepare_inputs import PreparedInputs

logger = logging.getLogger(__name__)

# Sizes below the first step of 8, as vLLM captures them.
SMALL_SIZES = (1, 2, 4)
SIZE_STEP = 8


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every 8 up to the largest decode-only step
    (`max_num_seqs` rows, at most one token each within the token budget), which is
    always included."""
    largest = min(max_num_seqs, max_num_batched_tokens)
    sizes = [s for s in SMALL_SIZES if s <= largest]
    sizes += range(SIZE_STEP, largest + 1, SIZE_STEP)
    if not sizes or sizes[-1] != largest:
        sizes.append(largest)
    return sizes


def is_decode_only(prepared: PreparedInputs) -> bool:
    """Whether every row of the step computes exactly one token and samples it."""
    num_reqs = prepared.seq_lens.shape[0]
    return (num_reqs > 0 and prepared.max_query_len == 1
            and prepared.positions.shape[0] == num_reqs
            and prepared.sampled_rows.shape[0] == num_reqs)


@dataclass
class GraphInputs:
    """The device views a step of one size reads (all int64; slices of one buffer)."""

    input_ids: torch.Tensor  # (size,)
    positions: torch.Tensor  # (size,)
    slot_mapping: torch.Tensor  # (size,)
    query_start_loc: torch.Tensor  # (size + 1,)
    seq_lens: torch.Tensor  # (size,)


# model(input_ids, positions, kv_caches, metadata) -> hidden; logits(hidden) -> logits.
ForwardFn = Callable[[torch.Tensor, torch.Tensor, list[KVCacheView], AttentionMetadata],
                     torch.Tensor]
LogitsFn = Callable[[torch.Tensor], torch.Tensor]


class DecodeGraphs:
    """The decode graphs of one runner: fixed input buffers, one graph per size."""

    def __init__(self, sizes: list[int], block_table: torch.Tensor, max_model_len: int,
                 device: torch.device) -> None:
        if not sizes or sizes != sorted(set(sizes)):
            raise ValueError(f"capture sizes must be distinct and ascending, got {sizes}")
        self.sizes = sizes
        self.max_size = largest = sizes[-1]
        if block_table.shape[0] < largest:
            raise ValueError(f"the block table has {block_table.shape[0]} rows; the largest "
                             f"capture size is {largest}")
        self.block_table = block_table  # (max_num_reqs, max_num_blocks) on the device
        self.max_model_len = max_model_len
        self.device = device
        self.is_cuda = device.type == "cuda"
        # [input_ids | positions | slot_mapping | query_start_loc | seq_lens]
        self._offsets = (0, largest, 2 * largest, 3 * largest, 4 * largest + 1)
        capacity = 5 * largest + 1
        self.host = torch.zeros(capacity, dtype=torch.int64, pin_memory=self.is_cuda)
        self.buffer = (torch.zeros(capacity, dtype=torch.int64, device=device)
                       if self.is_cuda else self.host)
        self._copied: torch.cuda.Event | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # (largest size, vocab_size) float32: every graph writes its logits here. Outside
        # the graphs' pool, so what one graph allocates is free for the others (kept per
        # graph, the outputs alone would hold the sum of all sizes' logits).
        self.logits: torch.Tensor | None = None
        self._forward: tuple[ForwardFn, LogitsFn, list[KVCacheView]] | None = None

    # ------------------------------------------------------------------ sizes and inputs
    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest capture size that holds `num_reqs` rows (None: none does)."""
        index = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def inputs(self, size: int) -> GraphInputs:
        """The fixed device views of a step of `size` rows (the same tensors every step)."""
        ids, pos, slots, starts, lens = self._offsets
        buf = self.buffer
        return GraphInputs(buf[ids:ids + size], buf[pos:pos + size], buf[slots:slots + size],
                           buf[starts:starts + size + 1], buf[lens:lens + size])

    def stage(self, prepared: PreparedInputs, size: int) -> GraphInputs:
        """Writes the step's rows and `size - n` padding rows into the host buffer and
        moves the buffer to the device with one copy; returns the views of `size`."""
        n = prepared.seq_lens.shape[0]
        if self._copied is not None:
            self._copied.synchronize()  # async scheduling: the last copy may be queued still
        host = self.host.numpy()
        ids, pos, slots, starts, lens = self._offsets
        host[ids:ids + n] = prepared.input_ids
        host[ids + n:ids + size] = 0
        host[pos:pos + n] = prepared.positions
        host[pos + n:pos + size] = 0
        host[slots:slots + n] = prepared.slot_mapping
        host[slots + n:slots + size] = -1
        host[starts:starts + size + 1] = np.arange(size + 1)  # one token per row
        host[lens:lens + n] = prepared.seq_lens
        host[lens + n:lens + size] = 0
        if self.is_cuda:
            self.buffer.copy_(self.host, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self.inputs(size)

    def _metadata(self, size: int, inputs: GraphInputs) -> AttentionMetadata:
        # Planned for the longest sequence, so a graph holds for any lengths; the host
        # arrays are what the torch backend (CPU) reads, the Triton kernels never do.
        host = self.host.numpy()
        _, _, _, starts, lens = self._offsets
        return AttentionMetadata(
            num_reqs=size, num_actual_tokens=size, max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens,
            block_table=self.block_table[:size], slot_mapping=inputs.slot_mapping,
            query_start_loc_np=host[starts:starts + size + 1].astype(np.int32),
            seq_lens_np=host[lens:lens + size].astype(np.int32),
        )

    # ------------------------------------------------------------------ running
    def bind(self, model: ForwardFn, logits: LogitsFn, kv_caches: list[KVCacheView]) -> None:
        """The model, its logits projection and the KV cache the graphs run over."""
        self._forward = (model, logits, kv_caches)

    def _compute(self, size: int) -> torch.Tensor:
        if self._forward is None:
            raise RuntimeError("DecodeGraphs.bind must be called before running a step")
        model, logits, kv_caches = self._forward
        inputs = self.inputs(size)
        hidden = model(inputs.input_ids, inputs.positions, kv_caches,
                       self._metadata(size, inputs))
        return logits(hidden)  # (size, vocab_size)

    def run(self, num_reqs: int, size: int) -> torch.Tensor:
        """The logits of the staged step's first `num_reqs` rows: the graph of `size`
        replayed on a GPU, the same computation run eagerly elsewhere."""
        graph = self.graphs.get(size)
        if graph is None:
            if self.is_cuda:
                raise RuntimeError(f"no CUDA graph of size {size} was captured")
            return self._compute(size)[:num_reqs]
        graph.replay()
        assert self.logits is not None
        return self.logits[:num_reqs]

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, largest first (the smaller graphs reuse its memory pool);
        logs how long it took and the memory the graphs hold."""
        if not self.is_cuda:
            raise RuntimeError("CUDA graphs need a CUDA device")
        device = self.device
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Every row padding while capturing: the warm-up runs write no cache slot.
        empty = _empty_prepared()
        for size in reversed(self.sizes):
            self.stage(empty, size)
            logits = self._compute(size)  # compiles kernels, picks GEMMs outside capture
            if self.logits is None:
                self.logits = torch.empty((self.max_size, logits.shape[1]),
                                          dtype=logits.dtype, device=device)
            del logits
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[:size].copy_(self._compute(size))
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d CUDA graphs of decode steps (sizes %d..%d) in %.1f s; they "
                    "hold %.0f MiB", len(self.sizes), self.sizes[0], self.max_size,
                    time.perf_counter() - start, used / 2**20)


def _empty_prepared() -> PreparedInputs:
    """A step of no rows: staged at size B, it is B padding rows."""
    empty = np.zeros(0, dtype=np.int64)
    return PreparedInputs(
        req_indices=empty, cu_num_tokens=empty, arange=empty, positions=empty,
        token_indices=empty, input_ids=empty, block_table_indices=empty, block_numbers=empty,
        block_offsets=empty, slot_mapping=empty, query_start_loc=np.zeros(1, dtype=np.int32),
        seq_lens=empty, max_query_len=0, max_seq_len=0, sampled_rows=empty,
        logits_indices=empty,
    )
