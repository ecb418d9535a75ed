"""The KV transfer metrics (`kvferry:kv_*`), rendered from the engine's latest snapshot.

The transfer layer's counters are cumulative in the core (KVTransferStats, carried in each
step's SchedulerStats), so this collector exports the last snapshot as it is: counters,
the pull-duration histogram with its buckets made cumulative, and the gauges. Params the
front end refused before they reached the core (admission.py) are added to the failures
and fallbacks. A server without a KV connector exports none of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

from kvferry.kvtransfer.admission import TransferAdmission
from kvferry.kvtransfer.metrics import PULL_SECONDS_BUCKETS, FailureReason, KVTransferStats
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector


class KVTransferCollector(Collector):
    """Exports the newest transfer snapshot handed to `update`."""

    def __init__(self, model_name: str, admission: TransferAdmission | None = None) -> None:
        self.model_name = model_name
        self.admission = admission
        self._stats: KVTransferStats | None = None
        self._num_fallbacks = 0
        self._num_waiting_for_remote_kv = 0
        self._num_cross_cache_hits = 0

    def update(self, stats: KVTransferStats | None, num_fallbacks: int,
               num_waiting_for_remote_kv: int, num_cross_cache_hits: int = 0) -> None:
        if stats is not None:
            self._num_cross_cache_hits = num_cross_cache_hits
            self._stats = stats
            self._num_fallbacks = num_fallbacks
            self._num_waiting_for_remote_kv = num_waiting_for_remote_kv

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        if s is None:
            return
        labels, values = ["model_name"], [self.model_name]
        yield _counter("kvferry:kv_transfer_bytes", "Bytes of KV pulled from remote engines",
                       labels, values, s.bytes_pulled)
        yield self._pull_seconds(s)
        refused, refused_fallbacks = self._refused_by_front_end()
        failures = CounterMetricFamily("kvferry:kv_transfer_failures",
                                       "Failed KV pulls by reason", labels=["model_name", "reason"])
        for reason in FailureReason:
            count = s.failures.get(reason.value, 0) + refused.get(reason.value, 0)
            failures.add_metric([self.model_name, reason.value], count)
        yield failures
        yield _counter("kvferry:kv_transfer_fallbacks",
                       "Requests whose pull failed and that were computed here instead",
                       labels, values, self._num_fallbacks + refused_fallbacks)
        held = GaugeMetricFamily("kvferry:kv_blocks_held_for_transfer",
                                 "KV blocks held for remote pulls", labels=labels)
        held.add_metric(values, s.blocks_held)
        yield held
        # vLLM counts these in num_requests_waiting only; a stuck producer shows here.
        waiting = GaugeMetricFamily("kvferry:num_requests_waiting_for_remote_kv",
                                    "Requests whose blocks are allocated and wait for a pull",
                                    labels=labels)
        waiting.add_metric(values, self._num_waiting_for_remote_kv)
        yield waiting
        yield _counter("kvferry:kv_lease_expirations",
                       "Holds ended because no pull or heartbeat came within the lease",
                       labels, values, s.lease_expirations)
        yield _counter("kvferry:cross_attention_bytes_pulled",
                       "Of the bytes pulled, those of cross-attention blocks (an encoder "
                       "pod's output)", labels, values, s.cross_bytes_pulled)
        yield _counter("kvferry:cross_attention_pull_seconds",
                       "Seconds of the pulls that moved cross-attention blocks",
                       labels, values, s.cross_pull_seconds_sum)
        yield _counter("kvferry:cross_block_cache_hits",
                       "Requests with an encoder pod's params whose cross-attention blocks "
                       "were cached here already (nothing pulled)", labels, values,
                       self._num_cross_cache_hits)

    def _refused_by_front_end(self) -> tuple[dict[str, int], int]:
        if self.admission is None:
            return {}, 0
        return self.admission.metrics.snapshot().failures, self.admission.num_fallbacks

    def _pull_seconds(self, s: KVTransferStats) -> HistogramMetricFamily:
        bounds = [str(b) for b in PULL_SECONDS_BUCKETS] + ["+Inf"]
        cumulative = list(accumulate(s.pull_seconds_buckets))
        family = HistogramMetricFamily("kvferry:kv_transfer_seconds",
                                       "Seconds a KV pull took", labels=["model_name"])
        family.add_metric([self.model_name], list(zip(bounds, cumulative)), s.pull_seconds_sum)
        return family


def _counter(name: str, doc: str, labels: list[str], values: list[str], value: float) -> Metric:
    family = CounterMetricFamily(name, doc, labels=labels)
    family.add_metric(values, value)
    return family
