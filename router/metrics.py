"""The router's Prometheus metrics (`kvferry:router_*`): hops, retries, fallbacks, choices."""

from __future__ import annotations

from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)


class Labelled(Generic[M]):
    """A labelled metric whose children are looked up once per label set: prometheus_client's
    own `labels()` validates, takes a lock and builds a tuple on every call, which on the
    request path costs more than the increment it precedes."""

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def labels(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

HOP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
               30.0, 60.0, 120.0)


class RouterMetrics:
    """One registry per router, so tests can run several in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Labelled(Counter(
            "kvferry:router_requests", "Client requests by endpoint and status",
            ["endpoint", "status"], registry=r))
        self.hop_requests = Labelled(Counter(
            "kvferry:router_hop_requests", "Requests sent to pods, by hop and outcome",
            ["hop", "outcome"], registry=r))
        self.hop_latency = Labelled(Histogram(
            "kvferry:router_hop_latency_seconds",
            "Seconds from sending a hop to its response headers (prefill: to its whole answer)",
            ["hop"], buckets=HOP_BUCKETS, registry=r))
        self.retries = Labelled(Counter(
            "kvferry:router_retries", "Hops retried on another pod", ["hop"], registry=r))
        self.prefill_fallbacks = Labelled(Counter(
            "kvferry:router_prefill_fallbacks",
            "Requests sent straight to decode because the prefill pool was down or failed",
            ["reason"], registry=r))
        self.prefill_skips = Labelled(Counter(
            "kvferry:router_prefill_skips",
            "Requests sent straight to decode by choice: their prompt was below the threshold "
            "(short_prompt), the decode pod picked holds all of it but a tail below the "
            "threshold (cached_on_decode), they are not one prompt with n == 1 "
            "(not_one_prompt: the prefill pod hands over one sequence's KV), or they ask for "
            "their prompt's logprobs (prompt_logprobs: the answering pod computes the prompt), "
            "or go to an encoder-decoder model (encoder_decoder: its decode pod runs the "
            "short decoder prompt itself)",
            ["reason"], registry=r))
        self.encode_hops = Labelled(Counter(
            "kvferry:router_encode_hops",
            "Requests to an encoder-decoder model whose encode hop ran on the encoder pool "
            "and handed its cross-attention blocks on to the decode pod, by endpoint",
            ["endpoint"], registry=r))
        self.encode_skips = Labelled(Counter(
            "kvferry:router_encode_skips",
            "Requests to an encoder-decoder model sent straight to decode by choice: the "
            "decode pod picked holds the encoder input's cross-attention blocks already "
            "(cached_on_decode), or they are not one prompt with n == 1 (not_one_prompt: a "
            "batch, n > 1 or chat messages, which the decode pod encodes itself)",
            ["reason"], registry=r))
        self.encode_fallbacks = Labelled(Counter(
            "kvferry:router_encode_fallbacks",
            "Requests to an encoder-decoder model sent straight to decode (whose pod runs "
            "the encoder itself) because the encoder pool had no live pod "
            "(no_live_encoder_pod), turned the hop away as busy or stopping (encoder_refused: "
            "429 or 503 from every pod tried), or failed it (encoder_failed)",
            ["reason"], registry=r))
        self.pod_chosen = Labelled(Counter(
            "kvferry:router_pod_chosen", "Pods chosen, per pool and policy",
            ["pool", "policy", "pod"], registry=r))
        self.predicted_hit_tokens = Labelled(Counter(
            "kvferry:router_predicted_prefix_hit_tokens",
            "Prompt tokens predicted to be in the chosen pod's prefix cache", ["pool"], registry=r))
        self.tokenized = Labelled(Counter(
            "kvferry:router_tokenized_prompts",
            "Prompts tokenized for routing, by where: the router's own tokenizer or a pod's "
            "/tokenize", ["where"], registry=r))
        self.kv_events = Gauge("kvferry:router_kv_event_batches",
                               "KV event batches (one engine step each) applied to the prefix "
                               "index since the router started", registry=r)
        self.registry_rejected = Labelled(Counter(
            "kvferry:router_registry_rejected",
            "Pod records and KV event batches in Redis the router ignored: malformed, "
            "unsigned or bad_signature (with the service's key), or out_of_range values",
            ["reason"], registry=r))
        self.pods_dropped = Labelled(Counter(
            "kvferry:router_pods_dropped",
            "Pods taken out of routing, by pool and reason: left (their record said they "
            "stop), refused (no connection could be opened to them) or expired (their record "
            "missing for longer than the grace period)", ["pool", "reason"], registry=r))
        self.pods_late = Gauge(
            "kvferry:router_pods_late",
            "Pods still routed to though their registry record is missing (within the "
            "grace period)", registry=r)
        self.connection_waits = Gauge(
            "kvferry:router_hops_waiting_for_connection",
            "Hops waiting for a connection to their pod to come free (the pod has "
            "--max-pod-connections open)", registry=r)
        self.stream_errors = Counter("kvferry:router_stream_errors",
                                     "Answers cut off by a pod failing mid-stream", registry=r)
        self.unknown_request_fields = Counter(
            "kvferry:router_unknown_request_fields",
            "Request fields that neither OpenAI's nor vLLM's schema has (relayed to the pods, "
            "which ignore them; each name is logged once)", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
