"""Encoder disaggregation: an encoder pool and a decode pool against colocated pods.

Under `kvferry up`, one Whisper-shaped random model (whisper-tiny's sizes, as
encdec_throughput.py builds it) served two ways, one after the other:

- disaggregated: 1 encoder pod (`--role encoder`) + 1 decode pod pulling each request's
  cross-attention blocks over NIXL, the router's encode hop in front;
- colocated: 2 pods (`--role both`) that run encoder and decoder in the same steps.

Each is given Poisson arrivals of 5-30 s of synthetic audio, streamed (`stream=true`), at
each rate of `--rates`. The transcription API has no token limit: a transcript runs to its
end token or the decoder's context, which the services cut to 132 positions, so the random
model (which rarely meets its end token) writes about 128 tokens per request. Measured at the client: time to first token and
inter-token latency (p50, p99). From the pods' metrics: the cross-attention pull's seconds
per request over the encoder's compute seconds per request (the encoder pod's end-to-end
time less its queue time). The ratio reported is disaggregated p99 inter-token latency over
colocated's at the highest rate the colocated service sustains (its completions keep up
with the arrivals); a PNG plots both.

With `--pin`, each pod is pinned to a core of its own (round robin over the machine's
cores) with one torch thread, as a pod with a CPU limit of 1 would run on a cluster, so
that the encoder pod's work cannot land on the decode pod's core; by default the pods are
left to the OS scheduler. The router, Redis and the client are never pinned.

    python benchmarks/encoder_disagg.py [--rates 0.5 1 2 3] [--num-requests 16]
    python benchmarks/encoder_disagg.py --quick     # a tiny model: a smoke run

The last line printed is one JSON object with the figures (`ratio`, `pull_over_encode`).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

import encdec_throughput as shapes  # noqa: E402

TARGET_RATIO = 0.5
TARGET_PULL_OVER_ENCODE = 0.2
SAMPLING_RATE = 16000
START_TIMEOUT_S = 600


@dataclass
class RequestTiming:
    """One streamed transcription as the client saw it."""

    sent: float
    first: float | None = None
    tokens: list[float] = field(default_factory=list)
    ok: bool = False

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    def gaps(self) -> list[float]:
        return list(np.diff(self.tokens)) if len(self.tokens) > 1 else []


@dataclass
class RateResult:
    rate: float
    timings: list[RequestTiming]
    seconds: float

    @property
    def completed(self) -> int:
        return sum(t.ok for t in self.timings)

    def sustained(self) -> bool:
        """Every request finished, and finishing took no longer than 1.5x arriving."""
        arrival_span = max(t.sent for t in self.timings) - min(t.sent for t in self.timings)
        return self.completed == len(self.timings) and self.seconds <= 1.5 * arrival_span + 30

    def itl(self, q: float) -> float:
        gaps = [g for t in self.timings for g in t.gaps()]
        return float(np.percentile(gaps, q)) if gaps else float("nan")

    def ttft_q(self, q: float) -> float:
        values = [t.ttft for t in self.timings if t.ttft is not None]
        return float(np.percentile(values, q)) if values else float("nan")


# ---------------------------------------------------------------------- service
def manifest(name: str, model: Path, disaggregated: bool, max_model_len: int) -> dict[str, Any]:
    pools: dict[str, Any] = ({"encoder": {"replicas": 1}, "decode": {"replicas": 1}}
                             if disaggregated else {"decode": {"replicas": 2}})
    return {
        "apiVersion": "kvferry.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "whisper", "source": f"hostpath://{model}",
                      "type": "encoder-decoder",
                      "dtype": "float32", "maxModelLen": max_model_len},
            "engine": {"blockSize": 16,
                       "extraArgs": ["--kv-cache-memory-bytes", str(512 << 20)]},
            "pools": pools,
        },
    }


class Service:
    """`kvferry up -f` of a manifest, until stopped."""

    def __init__(self, tmp: Path, spec: dict[str, Any], pin: bool) -> None:
        path = tmp / f"{spec['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(spec))
        self.port = _free_port()
        self.log_path = tmp / f"{spec['metadata']['name']}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "OMP_NUM_THREADS": "1"} if pin else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvferry.cli", "up", "-f", str(path), "--port",
             str(self.port)], stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "ready: http" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvferry up did not start:\n{self.log()[-4000:]}")
            time.sleep(0.5)
        self.pods = dict(re.findall(r"pod (\S+): (http://127\.0\.0\.1:\d+)", self.log()))
        # Processes pinned, by pod.
        self.pinned: dict[str, int] = {}
        if pin:
            cores = sorted(os.sched_getaffinity(0))
            for i, name in enumerate(sorted(self.pods)):
                self.pinned[name] = pin_pod(name, cores[i % len(cores)])
            print(f"  pods pinned (processes each): {self.pinned}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pod(self, pool: str) -> str:
        return next(url for name, url in self.pods.items() if f"-{pool}-" in name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def pin_pod(name: str, core: int) -> int:
    """Every thread of every process of pod `name` (its server and engine-core processes:
    those whose environment names the pod) onto `core`; how many processes."""
    marker = f"KVFERRY_POD_NAME={name}".encode()
    num_processes = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            for task in (proc / "task").iterdir():
                os.sched_setaffinity(int(task.name), {core})
            num_processes += 1
        except (OSError, ProcessLookupError):
            continue  # gone, or not ours
    return num_processes


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30, trust_env=False).text.splitlines():
        if line and not line.startswith("#"):
            sample, _, value = line.rpartition(" ")
            out[sample] = out.get(sample, 0.0) + float(value)
    return out


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.split("{")[0] == name)


# ---------------------------------------------------------------------- load
def wav_bytes(clip: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLING_RATE)
        out.writeframes((np.clip(clip, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


async def transcribe(client: httpx.AsyncClient, url: str, audio: bytes,
                     timing: RequestTiming) -> None:
    data = {"model": "whisper", "stream": "true", "temperature": "0"}
    files = {"file": ("clip.wav", audio, "audio/wav")}
    async with client.stream("POST", url + "/v1/audio/transcriptions", data=data,
                             files=files) as response:
        if response.status_code != 200:
            await response.aread()
            print(f"  request failed: {response.status_code} {response.text[:200]}")
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            now = time.perf_counter()
            if event.get("type") == "transcript.text.delta":
                if timing.first is None:
                    timing.first = now
                timing.tokens.append(now)
            elif event.get("type") == "transcript.text.done":
                timing.ok = True


async def run_rate(url: str, clips: list[bytes], rate: float, seed: int) -> RateResult:
    rng = np.random.default_rng(seed)
    timings = [RequestTiming(0.0) for _ in clips]
    limits = httpx.Limits(max_connections=len(clips) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:
        start = time.perf_counter()
        tasks = []
        for audio, timing in zip(clips, timings):
            timing.sent = time.perf_counter()
            tasks.append(asyncio.create_task(transcribe(client, url, audio, timing)))
            await asyncio.sleep(rng.exponential(1.0 / rate))
        await asyncio.gather(*tasks)
    return RateResult(rate, timings, time.perf_counter() - start)


def measure(service: Service, clips: list[list[bytes]], rates: list[float],
            seed: int) -> list[RateResult]:
    """`clips[i]` at `rates[i]` (each rate its own audio: a repeated file would be served
    from cached cross-attention blocks); `clips[-1]` warms the service up."""
    asyncio.run(run_rate(service.url, clips[-1], 10.0, seed))
    results = []
    for rate, batch in zip(rates, clips):
        result = asyncio.run(run_rate(service.url, batch, rate, seed))
        print(f"  {rate:g} req/s: {result.completed}/{len(batch)} done in {result.seconds:.1f} s;"
              f" TTFT p50 {result.ttft_q(50):.3f} s p99 {result.ttft_q(99):.3f} s; ITL p50 "
              f"{result.itl(50) * 1e3:.1f} ms p99 {result.itl(99) * 1e3:.1f} ms")
        results.append(result)
    return results


def pull_over_encode(service: Service) -> tuple[float, float, float]:
    """(mean pull seconds, mean encoder seconds, their ratio) from the pods' metrics."""
    decode, encoder = metrics(service.pod("decode")), metrics(service.pod("encoder"))
    pulls = total(decode, "kvferry:kv_transfer_seconds_count")
    pull_s = total(decode, "kvferry:cross_attention_pull_seconds_total") / max(pulls, 1)
    count = total(encoder, "vllm:e2e_request_latency_seconds_count")
    e2e = total(encoder, "vllm:e2e_request_latency_seconds_sum")
    queue = total(encoder, "vllm:request_queue_time_seconds_sum")
    encode_s = (e2e - queue) / max(count, 1)
    return pull_s, encode_s, pull_s / encode_s if encode_s else float("nan")


def plot(path: Path, colocated: list[RateResult], disagg: list[RateResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, results in (("colocated (2 both)", colocated),
                          ("encoder + decode", disagg)):
        rates = [r.rate for r in results]
        axes[0].plot(rates, [r.itl(99) * 1e3 for r in results], marker="o", label=name)
        axes[1].plot(rates, [r.ttft_q(99) for r in results], marker="o", label=name)
    axes[0].set(xlabel="arrival rate (req/s)", ylabel="p99 inter-token latency (ms)")
    axes[1].set(xlabel="arrival rate (req/s)", ylabel="p99 time to first token (s)")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Up to where the colocated pods' encoder steps stall their decodes (on a 2-core
    # machine, 2-3 requests/s of 5-30 s audio), which is what the comparison is about.
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--png", default="encoder_disagg.png")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pin", action="store_true",
                        help="pin each pod to a core of its own, with one torch thread")
    args = parser.parse_args()
    shape = shapes.QUICK_SHAPE if args.quick else shapes.FULL_SHAPE
    num = min(args.num_requests, 4) if args.quick else args.num_requests
    seconds = (0.5, float(shape.max_seconds)) if args.quick else (5.0, 30.0)
    rates = args.rates[:1] if args.quick else args.rates
    clips = [[wav_bytes(c) for c in shapes.make_workload(n, seconds, (1, 1), args.seed + i).clips]
             for i, n in enumerate([num] * len(rates) + [2])]
    print(f"model: {shape}; {num} requests per rate, rates {rates}")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = shapes.build_checkpoint(tmp / "whisper", shape, args.seed)
        runs: dict[str, list[RateResult]] = {}
        figures: tuple[float, float, float] = (float("nan"),) * 3
        pinned: dict[str, int] = {}
        for name, disaggregated in (("colocated", False), ("disaggregated", True)):
            print(f"{name}:")
            service = Service(tmp, manifest(f"bench-{name}", model, disaggregated,
                                            min(132, shape.max_target_positions)), args.pin)
            pinned.update(service.pinned)
            try:
                runs[name] = measure(service, clips, rates, args.seed)
                if disaggregated:
                    figures = pull_over_encode(service)
            finally:
                service.stop()
    colocated, disagg = runs["colocated"], runs["disaggregated"]
    sustained = [i for i, r in enumerate(colocated) if r.sustained()] or [0]
    at = max(sustained)
    ratio = disagg[at].itl(99) / colocated[at].itl(99)
    pull_s, encode_s, pull_ratio = figures
    plot(Path(args.png), colocated, disagg)
    print(f"at {rates[at]:g} req/s (the highest the colocated service sustains): p99 ITL "
          f"disaggregated / colocated = {ratio:.2f} (target <= {TARGET_RATIO})")
    print(f"cross-attention pull {pull_s * 1e3:.1f} ms per request over encoder "
          f"{encode_s * 1e3:.1f} ms: {pull_ratio:.3f} (target <= {TARGET_PULL_OVER_ENCODE}); "
          f"plot: {args.png}")

    def table(results: list[RateResult]) -> list[dict[str, float]]:
        return [{"rate": r.rate, "completed": r.completed, "ttft_p50": round(r.ttft_q(50), 4),
                 "ttft_p99": round(r.ttft_q(99), 4), "itl_p50": round(r.itl(50), 5),
                 "itl_p99": round(r.itl(99), 5)} for r in results]

    print(json.dumps({
        "ratio": round(ratio, 3), "target_ratio": TARGET_RATIO, "rate": rates[at],
        "pull_over_encode": round(pull_ratio, 4),
        "target_pull_over_encode": TARGET_PULL_OVER_ENCODE,
        "pull_ms": round(pull_s * 1e3, 3), "encode_ms": round(encode_s * 1e3, 3),
        "colocated": table(colocated), "disaggregated": table(disagg), "png": args.png,
        "pinned": args.pin, "pinned_processes": pinned,
    }))


if __name__ == "__main__":
    main()
