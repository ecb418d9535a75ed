"""Sizing the KV cache: the memory left after the weights and the largest step's activations.

On a GPU the cache takes what `gpu_memory_utilization` of the device leaves once the model
is loaded and one profiling step of the largest size the scheduler can produce
(`max_num_batched_tokens` tokens through the model, `max_num_seqs` rows through the
sampler) has run, so no later step can run out of memory:

    budget = utilization * total - (total - free after profiling) - activation peak
             - decode graphs

`total - free` is everything resident now (weights, CUDA context, other processes); the
activation peak is the most the profiling step allocated above that, which every step of
that size allocates again. The decode graphs (cuda_graphs.py) keep their own memory pool
for good: what a decode step of the largest capture size allocates, measured by running
one (the smaller graphs reuse the pool). On CPU the budget is explicit
(`kv_cache_memory_bytes`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from kvferry.engine.attention.backend import AttentionMetadata, AttentionType
from kvferry.engine.models.encoder_decoder import EncoderBatch
from kvferry.engine.sample.metadata import SamplingMetadata
from kvferry.engine.sample.sampler import Sampler
from kvferry.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def gpu_kv_cache_budget(
    total_bytes: int, free_bytes: int, utilization: float, activation_peak_bytes: int,
    graph_bytes: int = 0,
) -> int:
    """Bytes the KV cache may take (negative when the weights, activations and decode
    graphs alone exceed the share of the device granted)."""
    in_use = total_bytes - free_bytes
    return int(total_bytes * utilization) - in_use - activation_peak_bytes - graph_bytes


def profile_batch(
    num_tokens: int, max_model_len: int, block_size: int, device: torch.device
) -> tuple[AttentionMetadata, torch.Tensor, int]:
    """Metadata, positions and cache blocks for `num_tokens` prompt tokens, split into
    requests of at most `max_model_len`: the largest prefill step the scheduler can make.

    Each request's blocks follow the previous one's, after the null block 0.
    """
    lengths = profile_lengths(num_tokens, max_model_len)
    blocks_per_req = -(-int(lengths.max()) // block_size)
    num_reqs = lengths.size
    block_table = 1 + np.arange(num_reqs * blocks_per_req, dtype=np.int32).reshape(num_reqs, -1)
    query_start_loc = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
    req_indices = np.repeat(np.arange(num_reqs), lengths)
    slots = block_table[req_indices, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size
    metadata = AttentionMetadata(
        num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=int(lengths.max()),
        max_seq_len=int(lengths.max()),
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(lengths).to(device),
        block_table=torch.from_numpy(block_table).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc_np=query_start_loc, seq_lens_np=lengths,
    )
    return metadata, torch.from_numpy(positions).to(device), 1 + num_reqs * blocks_per_req


@dataclass(frozen=True)
class EncoderProfile:
    """The largest encoder pass of an encoder-decoder model: `num_positions` encoder
    positions (the encoder budget) in inputs of at most `max_positions`."""

    num_positions: int
    max_positions: int
    # "tokens", or "audio" with `num_mel_bins` bins (frames = 2 * max_positions).
    encoder_input: str
    num_mel_bins: int = 0


def run_encoder_profile(
    model: torch.nn.Module, profile: EncoderProfile, vocab_size: int, views: list,
    block_size: int, dtype: torch.dtype, device: torch.device,
) -> None:
    """The encoder pass of the largest step, with its cross-attention writes (into the
    profiling cache's first blocks: their contents do not matter)."""
    if profile.encoder_input == "audio":
        num_inputs = max(profile.num_positions // profile.max_positions, 1)
        lengths = np.full(num_inputs, profile.max_positions, dtype=np.int32)
    else:
        lengths = profile_lengths(profile.num_positions, profile.max_positions)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(starts[-1])
    metadata = AttentionMetadata(
        num_reqs=lengths.size, num_actual_tokens=total, max_query_len=int(lengths.max()),
        max_seq_len=int(lengths.max()), query_start_loc=torch.from_numpy(starts).to(device),
        seq_lens=torch.from_numpy(lengths).to(device),
        block_table=torch.zeros((lengths.size, 0), dtype=torch.int32, device=device),
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        query_start_loc_np=starts, seq_lens_np=lengths, attn_type=AttentionType.ENCODER,
    )
    if profile.encoder_input == "audio":
        features = torch.randn((lengths.size, profile.num_mel_bins, 2 * profile.max_positions),
                               dtype=dtype, device=device)
        batch = EncoderBatch(metadata, input_features=features)
    else:
        positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
        batch = EncoderBatch(
            metadata, input_ids=torch.randint(0, vocab_size, (total,), device=device),
            positions=torch.from_numpy(positions).to(device))
    hidden = model.encode(batch)
    num_slots = views[0][0].shape[0] * block_size
    slots = torch.arange(total, device=device) % num_slots
    model.write_cross_kv(hidden, views, slots)


def profile_lengths(num_tokens: int, max_len: int) -> np.ndarray:
    """`num_tokens` split into requests of at most `max_len`."""
    lengths = np.full(num_tokens // max_len, max_len, dtype=np.int32)
    if num_tokens % max_len:
        lengths = np.append(lengths, num_tokens % max_len).astype(np.int32)
    return lengths


@torch.inference_mode()
def run_profile_step(
    model: torch.nn.Module, vocab_size: int, num_tokens: int, max_num_seqs: int,
    max_model_len: int, block_size: int, kv_cache_shape: tuple[int, ...],
    dtype: torch.dtype, device: torch.device, encoder: EncoderProfile | None = None,
) -> None:
    """The largest step: `num_tokens` through the model, then `max_num_seqs` rows of logits
    through the sampler with every filter on. Random token ids; the temporary cache it
    writes is freed on return. An encoder-decoder model first runs its largest encoder
    pass, and its decoder's cross-attention reads as many keys as its self-attention. A
    pipeline stage runs its own layers (on random inputs after the first stage) and only
    the last one computes logits and samples."""
    metadata, positions, num_blocks = profile_batch(num_tokens, max_model_len, block_size, device)
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]
    cache = torch.empty((num_blocks, *kv_cache_shape[1:]), dtype=dtype, device=device)
    views = [(cache[:, i, 0], cache[:, i, 1]) for i in range(cache.shape[1])]
    if encoder is not None:
        run_encoder_profile(model, encoder, vocab_size, views, block_size, dtype, device)
        metadata.cross = replace(metadata, attn_type=AttentionType.CROSS)
    input_ids = torch.randint(0, vocab_size, (num_tokens,), device=device)
    stage = getattr(model, "stage", None)
    if stage is None or stage.is_first:
        hidden = model(input_ids, positions, views, metadata)
    else:  # a later pipeline stage reads the previous one's hidden states and residual
        shape = (num_tokens, model.config.hidden_size)
        received = (torch.randn(shape, dtype=dtype, device=device),
                    torch.randn(shape, dtype=dtype, device=device))
        hidden = model(None, positions, views, metadata, intermediate=received)
    if isinstance(hidden, tuple):
        return  # a stage before the last: the next stage computes the logits
    num_rows = min(max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[:num_rows])  # (num_rows, vocab_size)
    params = [SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, logprobs=5,
                             presence_penalty=0.1)] * num_rows
    sampling = SamplingMetadata.build(params, [[1]] * num_rows, [[1]] * num_rows, {},
                                      vocab_size, device)
    Sampler()(logits, sampling)


def measure_gpu_kv_cache_budget(
    model: torch.nn.Module, vocab_size: int, num_tokens: int, max_num_seqs: int,
    max_model_len: int, block_size: int, kv_cache_shape: tuple[int, ...],
    dtype: torch.dtype, device: torch.device, utilization: float,
    encoder: EncoderProfile | None = None, graph_rows: int = 0,
) -> int:
    """Runs the profiling step on `device` (CUDA) and returns the KV cache budget in bytes;
    `graph_rows` > 0: less what decode graphs up to that many rows will hold."""
    activation_peak = _peak_bytes(device, lambda: run_profile_step(
        model, vocab_size, num_tokens, max_num_seqs, max_model_len, block_size,
        kv_cache_shape, dtype, device, encoder))
    # A decode step of `graph_rows` one-token requests: one request per token.
    graph_bytes = 0 if graph_rows == 0 else _peak_bytes(device, lambda: run_profile_step(
        model, vocab_size, graph_rows, graph_rows, 1, block_size, kv_cache_shape, dtype,
        device))
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = gpu_kv_cache_budget(total, free, utilization, activation_peak, graph_bytes)
    logger.info(
        "memory profile: %.2f GiB of %.2f GiB in use after loading, activation peak %.2f GiB "
        "(%d tokens, %d rows), decode graphs %.2f GiB (%d rows); KV cache budget %.2f GiB "
        "at gpu_memory_utilization %.2f",
        (total - free) / 2**30, total / 2**30, activation_peak / 2**30, num_tokens,
        min(max_num_seqs, num_tokens), graph_bytes / 2**30, graph_rows, budget / 2**30,
        utilization,
    )
    return budget


def _peak_bytes(device: torch.device, step: Callable[[], None]) -> int:
    """The most `step` allocates on `device` above what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - baseline
