"""What crosses between the engine core and the pipeline's worker processes.

Every message is one of these dataclasses, pickled (both ends are this package, on one
machine, started by the core). Each worker has its own pipe to the core:

- core -> worker, in order: `StageStart` (the layers and the process group to join; the
  worker answers `StageReady` with its KV block size), `InitializeKVCache` (answered by
  `KVCacheReady`), then `StepRequest`s (each stage applies every step's diff to its own
  persistent batch), `StepBitmask` right after a step with grammars (the last stage only),
  `RecoverFromFailedStep`, `ReleasePromptEmbeds` and `ShutdownStage`;
- worker -> core: every stage reports when it worked on each step (`StageTiming`, for the
  busy fraction of each stage); only the last stage answers steps (`StepDone` or
  `StepFailed`); any stage answers `StageFatal` as its last word when it cannot go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvferry.engine.config import CacheConfig
from kvferry.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvferry.engine.executor.partition import PipelineStage

if TYPE_CHECKING:
    import torch
    from kvferry.kvtransfer.ranked import RankAgentInfo, RankAgentSpec


@dataclass(frozen=True)
class StageStart:
    """Everything a worker needs to build its stage (sent once, first)."""

    stage: PipelineStage
    model_dir: str
    # torch dtype name ("float32", "bfloat16", ...) and device ("cpu", "cuda:1", ...).
    dtype: str
    device: str
    cache: CacheConfig
    max_num_reqs: int
    max_model_len: int
    max_num_batched_tokens: int
    attention_backend: str
    seed: int
    # torch.distributed: backend ("gloo", "nccl") and rendezvous (a file:// URL).
    dist_backend: str
    dist_init_method: str
    # Intra-op threads of the worker's torch (the machine's cores shared among stages).
    num_threads: int
    # GPU: what the KV cache may take of the device (the profiling step measures it).
    gpu_memory_utilization: float
    log_level: int
    # This worker's rank in its stage's tensor-parallel group, and the group's size. The
    # process group's rank of (stage s, tp rank t) is s * tp_size + t.
    tp_rank: int = 0
    tp_size: int = 1


@dataclass(frozen=True)
class StageReady:
    """The stage's model is loaded."""

    stage_index: int
    # Bytes of one KV block of the stage's layers.
    block_bytes: int
    # GPU: bytes the stage's KV cache may take after profiling; None on CPU (configured).
    kv_cache_budget: int | None


@dataclass(frozen=True)
class InitializeKVCache:
    """Allocate the stage's cache: the same number of blocks on every stage."""

    num_blocks: int
    # KV transfer: how to build the worker's NIXL agent, which registers the cache and
    # serves the core's transfer commands (kvtransfer/ranked.py) on the worker's second pipe.
    transfer: RankAgentSpec | None = None


@dataclass(frozen=True)
class KVCacheReady:
    stage_index: int
    # KV transfer: the worker's agent, its cache registered.
    transfer: RankAgentInfo | None = None


@dataclass
class StepRequest:
    """One microbatch: the scheduler's diff, for every stage."""

    step_id: int
    scheduler_output: SchedulerOutput
    # Tokens sampled (by the last stage) since the stages before it last heard, per
    # request: a decode's input on stage 0, each row's length everywhere. The last stage
    # records its own tokens and ignores this.
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # The last stage: a `StepBitmask` for this step follows on the pipe.
    has_grammar_bitmask: bool = False


@dataclass
class StepBitmask:
    """The grammar bitmask of a step (filled by the core while the stages ran)."""

    step_id: int
    req_ids: list[str]
    # (len(req_ids), num_words) int32, on the CPU; None when filling it failed (`error`).
    bitmask: torch.Tensor | None
    error: str | None = None


@dataclass(frozen=True)
class RecoverFromFailedStep:
    """A step failed: its requests are gone, every row is dropped (ModelRunner's
    `recover_from_failed_step`)."""

    failed_req_ids: list[str]


@dataclass(frozen=True)
class ReleasePromptEmbeds:
    req_ids: list[str]


@dataclass(frozen=True)
class ShutdownStage:
    pass


@dataclass(frozen=True)
class StageTiming:
    """When a stage worked on a step (`time.monotonic()`, one clock for the machine)."""

    step_id: int
    stage_index: int
    # From taking the step off the pipe to handing its output on (or answering).
    started: float
    finished: float
    # Of that, seconds spent waiting for the previous stage's output.
    recv_wait_s: float

    @property
    def busy_s(self) -> float:
        return self.finished - self.started - self.recv_wait_s


@dataclass
class StepDone:
    """The last stage's output of a step."""

    step_id: int
    output: ModelRunnerOutput


@dataclass(frozen=True)
class StepFailed:
    """A step failed on `stage_index` (the others passed the failure along)."""

    step_id: int
    stage_index: int
    message: str


@dataclass(frozen=True)
class StageFatal:
    """The worker cannot go on and exits (its model did not load, a peer is gone, ...)."""

    stage_index: int
    message: str
    # The checkpoint or a setting was refused (ValueError or OSError while starting), as
    # the single-process engine refuses it.
    is_refusal: bool = False
