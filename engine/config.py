"""Configuration: one dataclass per subsystem, validated on construction.

A component receives the config of its own subsystem, never the root `EngineConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvferry.kvtransfer.config import KVTransferConfig

SchedulingPolicy = Literal["fcfs", "priority"]


# The choices of `attention_backend` (`--attention-backend`).
ATTENTION_BACKENDS = ("auto", "torch", "triton")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class ModelConfig:
    """Which checkpoint to run and how."""

    # A local checkpoint directory, "demo", or a hub id where a network exists.
    model: str
    # Tokenizer directory; None uses the model's.
    tokenizer: str | None = None
    # "auto" (float32 on CPU, the checkpoint's dtype on GPU), "float32", "bfloat16", "float16".
    dtype: str = "auto"
    # Longest sequence (prompt + output) a request may reach; None takes the checkpoint's.
    max_model_len: int | None = None
    # Seed for the default random generator (unseeded sampling, demo weights).
    seed: int = 0
    # Name the server reports for the model; None uses `model`.
    served_model_name: str | None = None
    # Accept prompts given as embeddings (`{"prompt_embeds": tensor}`) in place of token ids.
    # Speculative decoding, should it ever exist, cannot be combined with this: a draft
    # model has no way to read another model's embeddings.
    enable_prompt_embeds: bool = False

    def __post_init__(self) -> None:
        _require(bool(self.model), "model must name a checkpoint directory, 'demo' or a hub id")
        _require(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len must be >= 1, got {self.max_model_len}",
        )


@dataclass
class CacheConfig:
    """The paged KV cache."""

    # Tokens per KV block.
    block_size: int = 16
    # Reuse the KV blocks of identical prompt prefixes across requests.
    enable_prefix_caching: bool = True
    # CPU: bytes of memory given to the KV cache (default 1 GiB).
    kv_cache_memory_bytes: int | None = None
    # GPU: fraction of device memory the engine may use in all (weights + KV cache).
    gpu_memory_utilization: float = 0.9
    # Exact number of blocks (including the null block), overriding the memory budget.
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            f"block_size must be a power of two in [1, 128], got {self.block_size}",
        )
        _require(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require(
            self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
            f"num_gpu_blocks_override must be >= 2 (block 0 is reserved), "
            f"got {self.num_gpu_blocks_override}",
        )


@dataclass
class SchedulerConfig:
    """Continuous batching limits."""

    # Requests running at once.
    max_num_seqs: int = 256
    # Tokens (prefill chunks + decodes) computed in one step.
    max_num_batched_tokens: int = 2048
    # Split a prompt that does not fit the step's remaining token budget.
    enable_chunked_prefill: bool = True
    # "fcfs": arrival order; "priority": lower `priority` value first, then arrival.
    policy: SchedulingPolicy = "fcfs"
    # Encoder positions (encoder-decoder models) run in one step, beside the token budget,
    # so a burst of long encoder inputs does not starve decoding. None: the larger of
    # max_num_batched_tokens and the model's longest encoder input.
    max_num_encoder_tokens: int | None = None
    # Overlapped scheduling: the engine core schedules step N+1 (its decodes carry an
    # output placeholder for the token step N has not sampled yet) before it waits for
    # step N's tokens, so the host's scheduling and bookkeeping run while the device
    # computes. Worth it where the device would otherwise wait for the host (a GPU); on
    # CPU the model is the host, so it only adds work (off by default).
    async_scheduling: bool = False
    # Microbatches in flight at once (a pipeline of P stages keeps P: the microbatch loop
    # of core/engine_core.py). Each has its own token budget and `max_num_seqs`; a
    # decoding request is in at most one, a prompt's chunks may follow each other through
    # the stages. 1: one step at a time. The loop keeps no more in flight than the
    # executor takes (its `max_concurrent_batches`: 1 for the in-process runner).
    max_concurrent_batches: int = 1
    # Filled in by the engine from ModelConfig once the checkpoint is known.
    max_model_len: int = 0

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        _require(
            self.max_concurrent_batches >= 1,
            f"max_concurrent_batches must be >= 1, got {self.max_concurrent_batches}",
        )
        _require(
            not (self.async_scheduling and self.max_concurrent_batches > 1),
            "async_scheduling overlaps one step with the next on one device; with "
            "max_concurrent_batches > 1 (pipeline stages) the microbatches overlap instead: "
            "set one of them",
        )
        _require(
            self.max_num_encoder_tokens is None or self.max_num_encoder_tokens >= 1,
            f"max_num_encoder_tokens must be >= 1, got {self.max_num_encoder_tokens}",
        )
        _require(
            self.policy in ("fcfs", "priority"),
            f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}",
        )


@dataclass
class ParallelConfig:
    """How the model is split over worker processes."""

    # Pipeline stages, each a worker process with a contiguous share of the layers and
    # their KV cache (engine/executor/). 1: the model runs in the engine core's process.
    pipeline_parallel_size: int = 1
    # Ranks each layer is sharded over. Only 1 runs yet: the engine refuses more when it
    # starts (a command line the operator renders with more is still well-formed).
    tensor_parallel_size: int = 1
    # Layers per stage, one count per stage, adding up to the model's layers; None splits
    # them evenly (the remainder to the first stages).
    pp_layer_partition: list[int] | None = None

    def __post_init__(self) -> None:
        _require(self.pipeline_parallel_size >= 1,
                 f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        _require(self.tensor_parallel_size >= 1,
                 f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        partition = self.pp_layer_partition
        if partition is None:
            return
        _require(len(partition) == self.pipeline_parallel_size,
                 f"pp_layer_partition has {len(partition)} entries ({partition}); "
                 f"pipeline_parallel_size is {self.pipeline_parallel_size}: give one layer "
                 "count per stage")
        _require(all(isinstance(c, int) and not isinstance(c, bool) and c >= 1
                     for c in partition),
                 f"pp_layer_partition must hold layer counts >= 1, got {partition}")

    @property
    def world_size(self) -> int:
        """Worker processes the engine starts (none when it is 1: the core runs the model)."""
        return self.pipeline_parallel_size * self.tensor_parallel_size


@dataclass
class EngineConfig:
    """Everything one engine needs; split into the subsystems' own configs."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Attention backend: "triton" (slot-mapped paged kernels), "torch" (the CPU path and
    # the reference), or "auto": Triton on a GPU, torch on CPU.
    attention_backend: str = "auto"
    # "cpu", "cuda", or "auto" (cuda when available).
    device: str = "auto"
    # Decode-only steps replay CUDA graphs on a GPU (runner/cuda_graphs.py); True runs
    # every step eagerly (no capture at start-up, no graph memory).
    enforce_eager: bool = False
    # KV transfer between engines (prefill/decode disaggregation); None: colocated only.
    kv_transfer: KVTransferConfig | None = None
    # Pipeline (and, later, tensor) parallelism.
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
            f"got {self.attention_backend!r}",
        )
