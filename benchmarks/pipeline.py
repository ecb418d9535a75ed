"""The microbatch loop against the synchronous loop, on a pipeline simulated in time.

A pipeline of P stages, each busy `--stage-ms` per microbatch (engine/executor/simulated.py:
the wait is a timer, so the 2-core machine's speed does not blur it), with tokens that
depend on their position only (no model runs). The same workload goes through the engine
twice per P:

- the synchronous loop: one microbatch at a time, so each step takes P stage times;
- the microbatch loop (`max_concurrent_batches = P`, seed 001's two-stage loop): up to P
  microbatches in flight, each with its own `max_num_seqs` and token budget.

Printed per P: output tokens/s of each, their ratio (ideal: P) and the bubble fraction of
the microbatch loop (the share of the stages' time with no microbatch: 1 - busy / wall).
Target: ratio >= 0.9 P at P = 2 and 4. The last line is one JSON object with `ratio_p2`,
`ratio_p4`.

    python benchmarks/pipeline.py [--stage-ms 5] [--requests 96] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import build_checkpoint
from offline_throughput import ModelShape

TARGET = 0.9  # of P
SHAPE = ModelShape(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                   intermediate_size=64, vocab_size=512, max_position_embeddings=512)
MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 64


def make_engine(path: Path, batches: int, num_stages: int, stage_s: float) -> Any:
    """An engine whose steps go through `num_stages` simulated stages, with at most
    `batches` microbatches in flight."""
    from kvferry.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from kvferry.engine.executor.simulated import FakeTokens, SimulatedPipeline
    from kvferry.engine.frontend.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), max_model_len=256),
        cache=CacheConfig(block_size=16, num_gpu_blocks_override=2048),
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS,
                                  max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                  max_concurrent_batches=batches),
        device="cpu",
    ))
    engine.engine_core.executor = SimulatedPipeline(FakeTokens(SHAPE.vocab_size), num_stages,
                                                    stage_s)
    return engine


def run(engine: Any, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """Seconds to finish every request, and output tokens produced."""
    from kvferry.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
    produced = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                produced += len(output.outputs[0].token_ids)
    return time.perf_counter() - start, produced


def measure(path: Path, num_stages: int, stage_s: float, prompts: list[list[int]],
            output_len: int) -> dict[str, float]:
    sync = make_engine(path, 1, num_stages, stage_s)
    sync_s, sync_tokens = run(sync, prompts, output_len)
    overlapped = make_engine(path, num_stages, num_stages, stage_s)
    pipeline = overlapped.engine_core.executor
    over_s, over_tokens = run(overlapped, prompts, output_len)
    if sync_tokens != over_tokens or over_tokens != len(prompts) * output_len:
        raise RuntimeError(f"token counts differ: {sync_tokens} and {over_tokens}")
    busy = sum(pipeline.busy_seconds) / num_stages
    figures = {"sync_tok_s": sync_tokens / sync_s, "tok_s": over_tokens / over_s,
               "ratio": sync_s / over_s, "bubble": max(0.0, 1 - busy / over_s),
               "max_in_flight": pipeline.max_in_flight}
    print(f"P={num_stages}: synchronous {figures['sync_tok_s']:,.0f} tok/s, microbatches "
          f"{figures['tok_s']:,.0f} tok/s: ratio {figures['ratio']:.2f} (ideal {num_stages}, "
          f"target {TARGET * num_stages:.1f}); bubble {100 * figures['bubble']:.1f}%; "
          f"{pipeline.max_in_flight} in flight at most", flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage-ms", type=float, default=5.0)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="few requests (checks the script)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    num_requests, output_len = (16, 6) if args.quick else (args.requests, args.output_len)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, SHAPE.vocab_size, size=args.prompt_len).tolist()
               for _ in range(num_requests)]
    figures: dict[str, Any] = {"benchmark": "pipeline", "stage_ms": args.stage_ms,
                               "requests": num_requests, "max_num_seqs": MAX_NUM_SEQS,
                               "target_fraction_of_p": TARGET}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny"
        import torch

        build_checkpoint(path, SHAPE, torch.float32, 0)
        for num_stages in (2, 4):
            result = measure(path, num_stages, args.stage_ms / 1e3, prompts, output_len)
            figures[f"ratio_p{num_stages}"] = round(result["ratio"], 3)
            figures[f"bubble_p{num_stages}"] = round(result["bubble"], 4)
            figures[f"tok_s_p{num_stages}"] = round(result["tok_s"], 1)
            figures[f"sync_tok_s_p{num_stages}"] = round(result["sync_tok_s"], 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
