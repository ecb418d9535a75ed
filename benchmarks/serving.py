"""Serving benchmark: a load generator against a live `kvferry serve`, compared with offline
`LLM.generate` on the same model and workload, measured in the same run.

Workload: synthetic prompts (random token ids, prompt and output lengths uniform in the
given ranges) or a ShareGPT-format JSON file (the first human turn is the prompt, the
length of the first reply is the output length). Every request is greedy with EOS
ignored, so both paths generate exactly the same number of tokens.

Load: Poisson arrivals at each `--request-rates` value (`inf` sends everything at once),
optionally capped at `--max-concurrency` requests in flight. Every request streams, so
time to first token, inter-token latency and end-to-end latency are measured per request
by the client.

Reported: request and output-token throughput and latency percentiles per rate, written
to `--output-json` and drawn against request rate in `--plot`; and the ratio of output
tokens/s through the server at saturation (rate inf) to offline `LLM.generate`'s (target
>= 0.9: the HTTP and process boundary cost under 10%). The last line is one JSON object.

    python benchmarks/serving.py [--quick] [--model DIR|demo] [--dataset sharegpt.json]
        [--num-requests 200] [--request-rates 4,16,inf] [--max-concurrency N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The OpenMP wait policy `kvferry serve` gives its engine core; the offline baseline in this
# process gets the same, set before torch loads, so both sides run the same kernels the same
# way (spinning workers are much slower on a busy machine, and would skew the ratio).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import ModelShape, build_checkpoint  # noqa: E402
from serving_load import (  # noqa: E402
    Request,
    RunSummary,
    jsonable,
    plot,
    print_summary,
    run_load,
    summarize,
    summary_of,
    synthetic_workload,
)

TARGET_RATIO = 0.9
# --quick: a generated model smaller than demo.
QUICK_SHAPE = ModelShape(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                         intermediate_size=256, vocab_size=1024, max_position_embeddings=1024)


# ---- workload ------------------------------------------------------------------------------


def sharegpt_workload(path: Path, num_requests: int, tokenizer: Any, max_model_len: int,
                      max_output: int) -> list[Request]:
    """Prompts and reply lengths of the first `num_requests` usable ShareGPT conversations."""
    requests = []
    for entry in json.loads(path.read_text()):
        turns = entry.get("conversations") or []
        if len(turns) < 2:
            continue
        prompt = tokenizer.encode(turns[0]["value"])
        num_output = min(max(len(tokenizer.encode(turns[1]["value"])), 4), max_output)
        if not prompt or len(prompt) + num_output > max_model_len:
            continue
        requests.append(Request(prompt, num_output))
        if len(requests) == num_requests:
            break
    if not requests:
        raise ValueError(f"{path}: no usable conversations (ShareGPT format expected)")
    return requests


# ---- offline baseline ----------------------------------------------------------------------


def offline_tokens_per_s(model: str, engine_kwargs: dict[str, Any], workload: list[Request],
                         repeats: int) -> tuple[float, float]:
    """(output tokens/s, seconds) of LLM.generate on the workload: the best of `repeats`
    runs after a warm-up."""
    from kvferry.engine.frontend.llm import LLM
    from kvferry.engine.sampling_params import SamplingParams

    llm = LLM(model=model, **engine_kwargs)
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in workload]
    prompts = [r.prompt_token_ids for r in workload]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert num_tokens == sum(r.max_tokens for r in workload), "offline token count mismatch"
    del llm
    gc.collect()
    return num_tokens / best, best


# ---- the server ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str, port: int, flags: list[str], log_path: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "kvferry.cli", "serve", "--model", model,
               "--host", "127.0.0.1", "--port", str(port), *flags]
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvferry serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("kvferry serve did not become ready")


# ---- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo",
                        help="checkpoint directory or 'demo' (--quick: a generated tiny Llama)")
    parser.add_argument("--dataset", type=Path, default=None, help="ShareGPT-format JSON")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--input-len", default="32,256", help="MIN,MAX prompt tokens")
    parser.add_argument("--output-len", default="32,128", help="MIN,MAX output tokens")
    parser.add_argument("--request-rates", default="4,8,16,inf",
                        help="comma-separated request rates (req/s); inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path, default=Path("serving_benchmark.json"))
    parser.add_argument("--plot", type=Path, default=Path("serving_latency.png"))
    parser.add_argument("--repeats", type=int, default=1,
                        help="measure offline and saturation this many times, keep the best "
                             "of each (steadier on a shared machine)")
    parser.add_argument("--quick", action="store_true", help="tiny model and workload (seconds)")
    if parser.parse_args(argv).quick:
        # Smaller defaults; options given on the command line still win.
        parser.set_defaults(model=None, num_requests=48, input_len="8,32", output_len="8,24",
                            request_rates="8,inf")
    return parser.parse_args(argv)


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def _rates(text: str) -> list[float]:
    return sorted(float(x) for x in text.split(","))


def build_workload(args: argparse.Namespace, model_dir: str) -> list[Request]:
    from kvferry.engine.models.source import resolve_model_source
    from kvferry.engine.frontend.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(resolve_model_source(model_dir))
    if args.dataset is not None:
        return sharegpt_workload(args.dataset, args.num_requests, tokenizer, args.max_model_len,
                                 _pair(args.output_len)[1])
    return synthetic_workload(args.num_requests, tokenizer.vocab_size, _pair(args.input_len),
                              _pair(args.output_len), args.seed)


def run(args: argparse.Namespace, model: str, workdir: Path) -> dict[str, Any]:
    workload = build_workload(args, model)
    # Prefix caching off: every run sends the same prompts, and a cache would favour repeats.
    engine_kwargs = {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                     "max_num_batched_tokens": args.max_num_batched_tokens, "dtype": "float32",
                     "enable_prefix_caching": False}
    offline_tps, offline_s = offline_tokens_per_s(model, engine_kwargs, workload, args.repeats)
    print(f"offline LLM.generate: {offline_tps:.1f} output tok/s ({offline_s:.2f} s, "
          f"{len(workload)} requests)", flush=True)
    summaries, saturated = serve_and_load(args, model, workload, workdir)
    ratio = saturated.output_tokens_per_s / offline_tps
    return {
        "ratio": round(ratio, 4),
        "target": TARGET_RATIO,
        "server_tokens_per_s": saturated.output_tokens_per_s,
        "offline_tokens_per_s": round(offline_tps, 2),
        "num_requests": len(workload),
        "num_failed": sum(s.num_failed for s in summaries),
        "runs": [jsonable(s) for s in summaries],
    }


def serve_flags(max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> list[str]:
    return [f"--max-model-len={max_model_len}", f"--max-num-seqs={max_num_seqs}",
            f"--max-num-batched-tokens={max_num_batched_tokens}", "--dtype=float32",
            "--no-enable-prefix-caching"]


def serve_and_load(args: argparse.Namespace, model: str, workload: list[Request],
                   workdir: Path) -> tuple[list[RunSummary], RunSummary]:
    """Every rate's summary, and the best saturated (rate inf) run of `--repeats`."""
    port = free_port()
    flags = serve_flags(args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens)
    proc = start_server(model, port, flags, workdir / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        asyncio.run(run_load(url, workload[:8], float("inf"), None, args.seed))  # warm-up
        summaries = []
        for rate in _rates(args.request_rates):
            results, duration = asyncio.run(
                run_load(url, workload, rate, args.max_concurrency, args.seed))
            summaries.append(summarize(results, duration, rate, args.max_concurrency))
            print_summary(summaries[-1])
        saturated = [s for s in summaries if s.request_rate == float("inf")]
        for _ in range(args.repeats - len(saturated) if saturated else args.repeats):
            results, duration = asyncio.run(
                run_load(url, workload, float("inf"), args.max_concurrency, args.seed))
            saturated.append(summarize(results, duration, float("inf"), args.max_concurrency))
            print_summary(saturated[-1])
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return summaries, max(saturated, key=lambda s: s.output_tokens_per_s)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvferry-serving-") as tmp:
        workdir = Path(tmp)
        model = args.model
        if model is None:
            model = str(workdir / "model")
            build_checkpoint(Path(model), QUICK_SHAPE, seed=args.seed)
        report = run(args, model, workdir)
    args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    plot([summary_of(r) for r in report["runs"]], args.plot)
    print(f"wrote {args.output_json} and {args.plot}")
    print(f"server / offline output tokens/s: {report['ratio']:.3f} (target >= {TARGET_RATIO})")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}))
    return 0 if report["num_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
