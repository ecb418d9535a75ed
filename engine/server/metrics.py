"""Prometheus metrics under vLLM's names, labelled with `model_name`.

The names are a contract (dashboards, the Gateway API Inference Extension and HPA adapter
rules read them). `EngineMetrics.record` is the AsyncLLM stats listener: it runs once per
engine step in the server process, sets the gauges from the scheduler's snapshot, and
adds the step's counts and latencies. The scheduler's counters (prefix cache, preemptions)
are cumulative in the snapshot, so only their growth since the previous one is added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry.engine.server.kv_metrics import KVTransferCollector
from kvferry.kvtransfer.metrics import KVTransferStats
from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from kvferry.engine.core.messages import SchedulerStats
    from kvferry.engine.frontend.stats import IterationStats
    from kvferry.kvtransfer.admission import TransferAdmission

__all__ = ["PROMETHEUS_CONTENT_TYPE", "EngineMetrics"]

# Bucket bounds (seconds), spanning a fast GPU step to a slow CPU request.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                       1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Encoder positions of a step: one short text up to a burst of 30 s audio inputs.
ENCODER_TOKEN_BUCKETS = (16, 64, 256, 1024, 1500, 3000, 6000, 12000, 24000, 48000)
# Finish reasons counted by vllm:request_success_total, present from the start at 0.
FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineMetrics:
    """The server's metrics in a registry of their own (no process-wide globals)."""

    def __init__(self, model_name: str, block_size: int, num_gpu_blocks: int,
                 enable_prefix_caching: bool, kv_transfer_enabled: bool = False,
                 admission: TransferAdmission | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._last_prefix_queries = 0
        # Per pipeline stage: the busy seconds last seen (the counter adds the growth).
        self._last_stage_busy: dict[int, float] = {}
        self._last_prefix_hits = 0
        self._last_preemptions = 0
        self._make_gauges(block_size, num_gpu_blocks, enable_prefix_caching)
        self._make_counters()
        self._make_histograms()
        self.kv_transfer = KVTransferCollector(model_name, admission)
        if kv_transfer_enabled:
            # Zeros from the start, so a rate() sees the first transfer.
            self.kv_transfer.update(KVTransferStats(), 0, 0)
        self.registry.register(self.kv_transfer)

    def _labels(self) -> dict[str, str]:
        return {"model_name": self.model_name}

    def _make_gauges(self, block_size: int, num_gpu_blocks: int,
                     enable_prefix_caching: bool) -> None:
        names = ["model_name"]
        r = self.registry
        self.num_running = Gauge("vllm:num_requests_running", "Requests in the running batch",
                                 names, registry=r).labels(**self._labels())
        self.num_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled",
                                 names, registry=r).labels(**self._labels())
        self.kv_cache_usage = Gauge("vllm:kv_cache_usage_perc",
                                    "Fraction of KV cache blocks in use (1 = full)",
                                    names, registry=r).labels(**self._labels())
        # Encoder-decoder models (zero for others).
        self.num_waiting_for_encoder = Gauge(
            "kvferry:num_requests_waiting_for_encoder",
            "Encoder-decoder requests waiting to be admitted (their encoder to run, or their "
            "cached cross-attention blocks to be taken)", names, registry=r,
        ).labels(**self._labels())
        self.num_microbatches = Gauge(
            "kvferry:microbatches_in_flight",
            "Microbatches submitted to the pipeline stages and not yet back", names,
            registry=r).labels(**self._labels())
        self.num_cross_blocks = Gauge(
            "kvferry:cross_attention_blocks_in_use",
            "KV blocks holding cross-attention keys and values of running requests",
            names, registry=r).labels(**self._labels())
        cache_info = Gauge("vllm:cache_config_info", "The KV cache configuration (value 1)",
                           ["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"],
                           registry=r)
        cache_info.labels(model_name=self.model_name, block_size=str(block_size),
                          num_gpu_blocks=str(num_gpu_blocks),
                          enable_prefix_caching=str(enable_prefix_caching)).set(1)

    def _make_counters(self) -> None:
        names = ["model_name"]
        r = self.registry
        labels = self._labels()
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens computed",
                                     names, registry=r).labels(**labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated",
                                         names, registry=r).labels(**labels)
        self.num_preemptions = Counter("vllm:num_preemptions", "Preemptions of running requests",
                                       names, registry=r).labels(**labels)
        # Its rate is the stage's busy fraction (time with a microbatch / wall time).
        self.stage_busy = Counter("kvferry:pipeline_stage_busy_seconds",
                                  "Seconds a pipeline stage spent computing microbatches",
                                  ["model_name", "stage"], registry=r)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache",
                                            names, registry=r).labels(**labels)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache",
                                         names, registry=r).labels(**labels)
        success = Counter("vllm:request_success", "Finished requests by finish reason",
                          ["model_name", "finished_reason"], registry=r)
        self.request_success = {
            reason: success.labels(model_name=self.model_name, finished_reason=reason)
            for reason in FINISH_REASONS
        }
        self._success_family = success
        self.encoder_tokens = Counter(
            "kvferry:encoder_tokens", "Encoder positions computed (encoder-decoder models)",
            names, registry=r).labels(**labels)
        self.unknown_request_fields = Counter(
            "kvferry:unknown_request_fields",
            "Request fields that neither OpenAI's nor vLLM's schema has (ignored; each name "
            "is logged once)", names, registry=r).labels(**labels)

    def _make_histograms(self) -> None:
        names = ["model_name"]
        r = self.registry
        labels = self._labels()

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Seconds from arrival to the first output token", TTFT_BUCKETS)
        # The older name of the inter-token histogram, kept for existing dashboards.
        self.time_per_output_token = histogram("vllm:time_per_output_token_seconds",
                                               "Seconds between output tokens",
                                               INTER_TOKEN_BUCKETS)
        self.inter_token = histogram("vllm:inter_token_latency_seconds",
                                     "Seconds between output tokens", INTER_TOKEN_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Seconds from arrival to finish", REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Seconds from arrival to first being scheduled",
                                    REQUEST_BUCKETS)
        self.step_encoder_tokens = histogram(
            "kvferry:encoder_tokens_per_step",
            "Encoder positions run by each step that ran an encoder (encoder-decoder models)",
            ENCODER_TOKEN_BUCKETS)

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        """The AsyncLLM stats listener: one engine step's state and events."""
        self.record_scheduler(scheduler)
        self.record_iteration(iteration)

    def record_scheduler(self, stats: SchedulerStats) -> None:
        self.num_running.set(stats.num_running_reqs)
        self.num_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.num_waiting_for_encoder.set(stats.num_waiting_for_encoder)
        self.num_cross_blocks.set(stats.num_cross_blocks)
        self.num_microbatches.set(stats.num_microbatches_in_flight)
        for stage, seconds in enumerate(stats.stage_busy_seconds):
            counter = self.stage_busy.labels(model_name=self.model_name, stage=str(stage))
            self._last_stage_busy[stage] = _add_growth(
                counter, seconds, self._last_stage_busy.get(stage, 0.0))
        if stats.num_step_encoder_tokens:
            self.encoder_tokens.inc(stats.num_step_encoder_tokens)
            self.step_encoder_tokens.observe(stats.num_step_encoder_tokens)
        self.kv_transfer.update(stats.kv_transfer, stats.num_kv_transfer_fallbacks,
                                stats.num_waiting_for_remote_kv, stats.num_cross_cache_hits)
        self._last_prefix_queries = _add_growth(
            self.prefix_cache_queries, stats.prefix_cache_queries, self._last_prefix_queries)
        self._last_prefix_hits = _add_growth(
            self.prefix_cache_hits, stats.prefix_cache_hits, self._last_prefix_hits)
        self._last_preemptions = _add_growth(
            self.num_preemptions, stats.num_preemptions, self._last_preemptions)

    def record_iteration(self, stats: IterationStats) -> None:
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for value in stats.time_to_first_tokens:
            self.ttft.observe(value)
        for value in stats.inter_token_latencies:
            self.inter_token.observe(value)
            self.time_per_output_token.observe(value)
        for value in stats.e2e_latencies:
            self.e2e.observe(value)
        for value in stats.queue_times:
            self.queue_time.observe(value)
        for reason in stats.finish_reasons:
            self._success(reason).inc()

    def _success(self, reason: str) -> Counter:
        if reason not in self.request_success:
            self.request_success[reason] = self._success_family.labels(
                model_name=self.model_name, finished_reason=reason)
        return self.request_success[reason]

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)


def _add_growth(counter: Counter, total: float, last: float) -> float:
    """Adds `total - last` to `counter` (a reset of the source counts from zero); returns total."""
    growth = total - last if total >= last else total
    if growth > 0:
        counter.inc(growth)
    return total
