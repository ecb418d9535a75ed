"""Engine flags shared by the command lines that start an engine, in vLLM's spelling.

Some defaults depend on the pod's part in disaggregated serving (`kvferry serve --role`); a
flag given on the command line (or rendered by the operator from the service's spec)
always wins over them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvferry.engine.config import (
    ATTENTION_BACKENDS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)


@dataclass(frozen=True)
class RoleDefaults:
    """Scheduler defaults of one role."""

    # Tokens computed per step.
    max_num_batched_tokens: int


# - prefill pods run prompts and nothing else: a large budget computes whole long prompts in
#   one step (throughput and time to first token; no decode waits behind them);
# - decode pods mostly decode (one token per request per step) and compute a prompt only to
#   recompute a failed pull: a small budget bounds how long such a prompt can stall every
#   running request's next token, and with max_num_seqs running it still leaves half the
#   budget for that prompt's chunks;
# - a colocated pod balances both, as a vLLM server does by default.
# max_num_seqs (256) stays the same everywhere: a prefill pod's requests leave after one
# step, and a decode pod's concurrency is bounded by its KV memory rather than by it.
ROLE_DEFAULTS = {
    "both": RoleDefaults(max_num_batched_tokens=2048),
    "prefill": RoleDefaults(max_num_batched_tokens=8192),
    "decode": RoleDefaults(max_num_batched_tokens=512),
}


def role_defaults(role: str) -> RoleDefaults:
    """The defaults of a `--role`; roles without their own take `both`'s."""
    return ROLE_DEFAULTS.get(role, ROLE_DEFAULTS["both"])


def _per_role_help(field: str) -> str:
    values = ", ".join(f"{role} {getattr(d, field)}" for role, d in ROLE_DEFAULTS.items())
    return f"default by --role: {values}"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `--model`, `--dtype`, `--max-model-len`, `--block-size`, ... to `parser`."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", required=True,
                       help="checkpoint directory, 'demo' (a small random model), or a hub id")
    group.add_argument("--tokenizer", default=None, help="tokenizer directory (default: model)")
    group.add_argument("--served-model-name", default=None,
                       help="model name clients use (default: the --model value)")
    group.add_argument("--dtype", default="auto",
                       choices=["auto", "float32", "bfloat16", "float16"],
                       help="weights and activations; auto is float32 on CPU, the "
                            "checkpoint's half precision (else bfloat16) on a GPU")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output (default: the checkpoint's)")
    group.add_argument("--seed", type=int, default=0,
                       help="seed of the engine's random state")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    caching = group.add_mutually_exclusive_group()
    caching.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                         action="store_true", default=True,
                         help="reuse the KV blocks of prompts' common prefixes (default: on)")
    caching.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                         action="store_false", help="turn prefix caching off")
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                       help="CPU: bytes for the KV cache (default 1 GiB)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of the GPU's memory the engine may take, KV cache "
                            "included")
    group.add_argument("--num-gpu-blocks-override", type=int, default=None,
                       help="KV cache blocks to allocate (default: as many as the memory "
                            "budget holds)")
    group.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens computed per step, prefill chunks and decodes together "
                            f"({_per_role_help('max_num_batched_tokens')})")
    group.add_argument("--max-num-encoder-tokens", type=int, default=None,
                       help="encoder-decoder models: encoder positions run per step, beside "
                            "the token budget (default: the larger of "
                            "--max-num-batched-tokens and the longest encoder input)")
    group.add_argument("--async-scheduling", action="store_true",
                       help="schedule step N+1 while step N computes (output placeholders for "
                            "tokens not sampled yet); for a GPU, where the device must not "
                            "wait for the host (default: off)")
    group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                       help="the order waiting requests are taken in")
    group.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                       help="triton: slot-mapped paged kernels; torch: the CPU path; auto "
                            "(default): triton on a GPU, torch on CPU")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    group.add_argument("--enforce-eager", action="store_true",
                       help="run every step eagerly: no CUDA graphs of decode steps (saves "
                            "their capture time and memory)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Builds (and so validates) the engine config from parsed flags.

    Flags left unset take their role's default (`args.role`; `both` without one).
    """
    defaults = role_defaults(getattr(args, "role", "both"))
    return EngineConfig(
        model=ModelConfig(
            model=args.model, tokenizer=args.tokenizer, dtype=args.dtype,
            max_model_len=args.max_model_len, seed=args.seed,
            served_model_name=args.served_model_name,
            # `kvferry serve --enable-prompt-embeds` (a flag of the server's inputs group).
            enable_prompt_embeds=getattr(args, "enable_prompt_embeds", False),
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=_given_or(args.max_num_batched_tokens,
                                             defaults.max_num_batched_tokens),
            policy=args.scheduling_policy,
            async_scheduling=args.async_scheduling,
            max_num_encoder_tokens=args.max_num_encoder_tokens,
        ),
        attention_backend=args.attention_backend,
        device=args.device,
        enforce_eager=args.enforce_eager,
        # `kvferry serve --pipeline-parallel-size/--tensor-parallel-size` (the server's
        # parallelism group).
        parallel=ParallelConfig(
            pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
            tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        ),
    )


def _given_or(value: int | None, default: int) -> int:
    return default if value is None else value
