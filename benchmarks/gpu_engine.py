"""The engine on one GPU: offline throughput against HF `generate`, one decode step against
the memory-bandwidth floor, how busy the GPU is during a decode step, and the server's
saturated throughput against the offline figure, all in one run on the same weights.

The model is Llama-3.2-1B-shaped with random bfloat16 weights (vocab 128,256, hidden 2,048,
16 layers, 32 heads, 8 KV heads, MLP 8,192), built in a temporary directory. The workload
is 256 requests with prompts of 128-1,024 random tokens and outputs of 128-256 tokens
(`ignore_eos`, greedy), fixed seed. Figures:

- `tok_s`: kvferry `LLM.generate` output tokens per second over the workload;
- `hf_tok_s`, `ratio_vs_hf`: HF `generate` in static batches of 64 (left-padded; a batch
  decodes as many tokens as its longest request asks for, only the asked-for tokens are
  counted), and kvferry over it;
- `decode_step_ms`, `floor_ms`, `floor_ratio`: the median engine step (`LLMEngine.step`,
  host work included) with 128 requests decoding at about 1,024 tokens of context, and the
  time the GPU needs at least to read the weights and that KV once, at the bandwidth of a
  device-to-device copy measured in the same run; `floor_ratio` = step / floor (target
  <= 2);
- `gpu_busy`: the share of those decode steps' wall time during which a kernel runs (the
  profiler's kernel intervals, merged);
- `server_tok_s`, `server_ratio`: `kvferry serve` on the same GPU, the workload sent at
  once through HTTP, over the offline figure.

`--smoke` runs the same code on a tiny model and workload on any device (CPU included),
so the script is tested where no GPU is. The last line is one JSON object.

    python benchmarks/gpu_engine.py [--device cuda] [--smoke] [--skip-server] [--skip-hf]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import (  # noqa: E402
    PAD_ID,
    ModelShape,
    Workload,
    hf_generate_batch,
    make_workload,
    quiet_hf,
    save_word_tokenizer,
)

TARGETS = {"tok_s": 20_000, "ratio_vs_hf": 15.0, "floor_ratio": 2.0, "gpu_busy": 0.9,
           "server_ratio": 0.9}


@dataclass(frozen=True)
class Setup:
    """The model and the workloads of one run."""

    shape: ModelShape
    num_requests: int
    prompt_lens: tuple[int, int]
    output_lens: tuple[int, int]
    hf_batch_size: int
    decode_batch: int
    decode_context: int
    max_model_len: int
    # Tokens per step: prefill chunks and decodes together (vLLM's offline default on an
    # H100 is larger still); fewer, larger prefill steps for the 147k prompt tokens.
    max_num_batched_tokens: int


FULL = Setup(
    shape=ModelShape(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                     intermediate_size=8192, vocab_size=128_256, max_position_embeddings=2048),
    num_requests=256, prompt_lens=(128, 1024), output_lens=(128, 256), hf_batch_size=64,
    decode_batch=128, decode_context=1024, max_model_len=2048, max_num_batched_tokens=8192,
)
SMOKE = Setup(
    shape=ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                     intermediate_size=128, vocab_size=512, max_position_embeddings=256),
    num_requests=12, prompt_lens=(8, 40), output_lens=(4, 12), hf_batch_size=4,
    decode_batch=4, decode_context=32, max_model_len=256, max_num_batched_tokens=256,
)


def build_checkpoint(path: Path, shape: ModelShape, dtype: torch.dtype, seed: int) -> None:
    """A random Llama of `shape`, saved in `dtype`, with a word-level tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        architectures=["LlamaForCausalLM"], num_hidden_layers=shape.num_layers,
        hidden_size=shape.hidden_size, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size, max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(str(path), safe_serialization=True)
    save_word_tokenizer(path, shape.vocab_size)


# ---------------------------------------------------------------------- the memory floor
def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second a device-to-device copy moves (read plus written), best of 5."""
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(shape: ModelShape, element_size: int) -> int:
    """Bytes of the weights one decode step reads (tied embeddings read once, as the head)."""
    h, i = shape.hidden_size, shape.intermediate_size
    head_size = h // shape.num_heads
    qkv = h * (shape.num_heads + 2 * shape.num_kv_heads) * head_size
    per_layer = qkv + shape.num_heads * head_size * h + 3 * h * i + 2 * h
    return element_size * (shape.num_layers * per_layer + shape.vocab_size * h + h)


def kv_bytes(shape: ModelShape, num_tokens: int, element_size: int) -> int:
    head_size = shape.hidden_size // shape.num_heads
    return element_size * num_tokens * shape.num_layers * 2 * shape.num_kv_heads * head_size


# ---------------------------------------------------------------------- kvferry offline
def make_llm(path: Path, setup: Setup, device: str, dtype: str, engine_flags: EngineFlags) -> Any:
    from kvferry import LLM

    return LLM(model=str(path), dtype=dtype, device=device, max_model_len=setup.max_model_len,
               max_num_seqs=max(setup.decode_batch, min(setup.num_requests, 256)),
               max_num_batched_tokens=setup.max_num_batched_tokens,
               async_scheduling=engine_flags.async_scheduling,
               enforce_eager=engine_flags.enforce_eager)


@dataclass(frozen=True)
class EngineFlags:
    """Engine settings of both the offline and the server runs."""

    async_scheduling: bool = False
    enforce_eager: bool = False

    def cli(self) -> list[str]:
        return ((["--async-scheduling"] if self.async_scheduling else [])
                + (["--enforce-eager"] if self.enforce_eager else []))


def run_offline(llm: Any, workload: Workload) -> float:
    """Output tokens per second of `LLM.generate` over the workload (greedy, ignore_eos)."""
    from kvferry import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    got = [len(o.outputs[0].token_ids) for o in outputs]
    if got != workload.output_lens:
        raise RuntimeError("kvferry returned other output lengths than asked for")
    return workload.num_output_tokens / seconds


def decode_steps(llm: Any, setup: Setup, device: torch.device, num_steps: int,
                 seed: int) -> tuple[list[float], float | None]:
    """Milliseconds of `num_steps` engine steps with `decode_batch` requests decoding at
    about `decode_context` tokens of context, and the share of a few more steps' wall time
    during which a kernel ran (None off CUDA)."""
    from kvferry.engine.frontend.output_processor import RequestOutputKind

    from kvferry import SamplingParams

    engine = llm.llm_engine
    rng = np.random.default_rng(seed)
    vocab = setup.shape.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 64, ignore_eos=True)
    for index in range(setup.decode_batch):
        prompt = rng.integers(PAD_ID + 1, vocab, setup.decode_context).tolist()
        # Final-only outputs, as LLM.generate asks for: no per-step copy of every output.
        engine.add_request(f"decode-{index}", {"prompt_token_ids": prompt}, params,
                           output_kind=RequestOutputKind.FINAL_ONLY)
    # Until every request has its first token: from then on a step is decode only.
    children = [child for parent in engine.output_processor.parents.values()
                for child in parent.children.values()]
    while not all(child.token_ids for child in children):
        engine.step()
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    busy = gpu_busy_share(engine, device) if device.type == "cuda" else None
    engine.abort_request([f"decode-{i}" for i in range(setup.decode_batch)])
    return times, busy


def gpu_busy_share(engine: Any, device: torch.device, num_steps: int = 8) -> float:
    """Merged kernel time over wall time across `num_steps` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        synchronize(device)
        wall_us = (time.perf_counter() - start) * 1e6
    kernels = [e for e in prof.events()
               if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    print_top_kernels(kernels, num_steps)
    intervals = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, current_start, current_end = 0.0, None, None
    for begin, end in intervals:
        if current_end is None or begin > current_end:
            if current_end is not None:
                busy += current_end - current_start
            current_start, current_end = begin, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        busy += current_end - current_start
    return min(1.0, busy / wall_us)


def print_top_kernels(kernels: list[Any], num_steps: int, top: int = 12) -> None:
    """Where a decode step's GPU time goes: the kernels of most total time, per step."""
    totals: dict[str, list[float]] = {}
    for event in kernels:
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += event.time_range.end - event.time_range.start
        entry[1] += 1
    print(f"GPU time per decode step by kernel (top {top}, us; launches):", flush=True)
    for name, (micros, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {micros / num_steps:9.1f}  {count / num_steps:5.0f}  {name[:100]}", flush=True)


# ---------------------------------------------------------------------- HF baseline
def run_hf(path: Path, workload: Workload, batch_size: int, device: torch.device,
           dtype: torch.dtype) -> float:
    """Output tokens per second of HF `generate`, static left-padded batches in order."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        new_tokens = max(workload.output_lens[first:first + batch_size])
        hf_generate_batch(model, workload.prompts[first:first + batch_size], new_tokens, device)
    synchronize(device)
    seconds = time.perf_counter() - start
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return workload.num_output_tokens / seconds


# ---------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_server(path: Path, setup: Setup, workload: Workload, device: str, dtype: str,
               log: Path, engine_flags: EngineFlags) -> float:
    """Output tokens per second of `kvferry serve` with the whole workload sent at once."""
    port = free_port()
    command = [sys.executable, "-m", "kvferry.cli", "serve", "--model", str(path),
               "--host", "127.0.0.1", "--port", str(port), "--device", device,
               "--dtype", dtype, "--max-model-len", str(setup.max_model_len),
               "--max-num-seqs", str(min(setup.num_requests, 256)),
               "--max-num-batched-tokens", str(setup.max_num_batched_tokens),
               "--served-model-name", "bench", "--uvicorn-log-level", "warning",
               *engine_flags.cli()]
    with log.open("wb") as out:
        # Outside the repository: its kvferry/ folder must not shadow the installed package.
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, log, 600)
        return asyncio.run(send_workload(f"http://127.0.0.1:{port}/v1/completions",
                                         workload, "bench"))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvferry serve exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"kvferry serve not ready in {timeout_s:.0f} s")


async def send_workload(url: str, workload: Workload, model: str) -> float:
    import aiohttp

    async def one(session: aiohttp.ClientSession, prompt: list[int], max_tokens: int) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        async with session.post(url, json=body) as response:
            data = await response.json()
            if response.status != 200:
                raise RuntimeError(f"the server answered {response.status}: {data}")
            return int(data["usage"]["completion_tokens"])

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        await one(session, workload.prompts[0][:8], 2)  # warm the path
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(session, p, n) for p, n in
                                        zip(workload.prompts, workload.output_lens)))
        seconds = time.perf_counter() - start
    if sum(counts) != workload.num_output_tokens:
        raise RuntimeError("the server returned other output lengths than asked for")
    return workload.num_output_tokens / seconds


# ---------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model and workload (any device; checks the script)")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the HF baseline")
    parser.add_argument("--skip-server", action="store_true", help="leave out the server run")
    parser.add_argument("--decode-steps", type=int, default=20)
    parser.add_argument("--async-scheduling", action="store_true",
                        help="the engine schedules a step while the GPU runs the last one")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    setup = SMOKE if args.smoke else FULL
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype_name = "bfloat16" if on_gpu else "float32"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    element_size = torch.empty((), dtype=dtype).element_size()
    quiet_hf()
    # The engine's start-up lines: memory profile, KV cache size, graph capture time.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("kvferry").setLevel(logging.INFO)
    name = torch.cuda.get_device_name(device) if on_gpu else f"cpu ({os.cpu_count()} cores)"
    print(f"device: {name}; model {setup.shape}; {dtype_name}", flush=True)
    figures: dict[str, Any] = {"benchmark": "gpu_engine", "device": name,
                               "smoke": args.smoke, "targets": TARGETS}
    workload = make_workload(setup.num_requests, setup.prompt_lens, setup.output_lens,
                             setup.shape.vocab_size, args.seed)
    with tempfile.TemporaryDirectory() as tmp_name:
        path = Path(tmp_name) / "llama-random"
        build_checkpoint(path, setup.shape, dtype, args.seed)
        bandwidth = copy_bandwidth(device, 1 << (30 if on_gpu else 26))
        figures["copy_gbps"] = round(bandwidth / 1e9, 1)
        print(f"device copy: {bandwidth / 1e9:.1f} GB/s", flush=True)

        engine_flags = EngineFlags(args.async_scheduling, args.enforce_eager)
        figures.update(async_scheduling=args.async_scheduling, enforce_eager=args.enforce_eager)
        llm = make_llm(path, setup, args.device, dtype_name, engine_flags)
        run_offline(llm, Workload(workload.prompts[:4], [4] * 4))  # warm-up
        tok_s = run_offline(llm, workload)
        figures["tok_s"] = round(tok_s, 4)
        print(f"kvferry offline: {tok_s:,.0f} output tokens/s "
              f"({workload.num_output_tokens} tokens, {setup.num_requests} requests)", flush=True)

        times, busy = decode_steps(llm, setup, device, args.decode_steps, args.seed)
        step_ms = statistics.median(times)
        num_kv_tokens = setup.decode_batch * (setup.decode_context + args.decode_steps // 2)
        floor_ms = 1e3 * (weight_bytes(setup.shape, element_size)
                          + kv_bytes(setup.shape, num_kv_tokens, element_size)) / bandwidth
        figures.update(decode_step_ms=round(step_ms, 4), floor_ms=round(floor_ms, 4),
                       floor_ratio=round(step_ms / floor_ms, 2),
                       gpu_busy=None if busy is None else round(busy, 3))
        print(f"decode step at batch {setup.decode_batch}, ~{setup.decode_context} context: "
              f"{step_ms:.2f} ms (floor {floor_ms:.2f} ms, {step_ms / floor_ms:.1f}x); GPU busy "
              f"{'n/a' if busy is None else f'{100 * busy:.0f}%'}", flush=True)
        del llm
        gc.collect()  # the engine's cycles hold its KV cache and graphs until collected
        if on_gpu:
            torch.cuda.empty_cache()

        if not args.skip_hf:
            hf_tok_s = run_hf(path, workload, setup.hf_batch_size, device, dtype)
            figures.update(hf_tok_s=round(hf_tok_s, 4), ratio_vs_hf=round(tok_s / hf_tok_s, 3))
            print(f"HF generate (batches of {setup.hf_batch_size}): {hf_tok_s:,.0f} tokens/s; "
                  f"kvferry / HF = {tok_s / hf_tok_s:.2f}", flush=True)
        if not args.skip_server:
            server_tok_s = run_server(path, setup, workload, args.device, dtype_name,
                                      Path(tmp_name) / "serve.log", engine_flags)
            figures.update(server_tok_s=round(server_tok_s, 4),
                           server_ratio=round(server_tok_s / tok_s, 3))
            print(f"kvferry serve, the workload at once: {server_tok_s:,.0f} tokens/s; "
                  f"server / offline = {server_tok_s / tok_s:.2f}", flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
