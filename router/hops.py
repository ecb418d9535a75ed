"""Sending one hop of a request to a pod, with one retry on another pod of the same pool.

A hop is retried when its pod refuses the connection, times out before answering, or
answers 429/5xx: in each case the client has seen nothing yet. Once the answer's headers
are in, the router is committed to that pod.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvferry.router.config import HopTimeouts
from kvferry.router.metrics import RouterMetrics
from kvferry.router.pods import Pod, PodDirectory
from kvferry.router.policies import Choice

# Statuses that mean "this pod cannot take it now", not "this request is wrong".
RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})


class HopError(Exception):
    """A hop failed on every pod it was tried on; `status` is what the client gets."""

    def __init__(self, message: str, status: int = 502, code: str = "bad_gateway") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class HopResponse:
    """An answer whose headers are in; `response` may still be streaming its body."""

    pod: Pod
    response: httpx.Response
    choice: Choice


def make_client(timeouts: HopTimeouts) -> httpx.AsyncClient:
    """One pooled client for every pod: keep-alive connections, no global request limit."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=2048,
                          keepalive_expiry=30.0)
    timeout = httpx.Timeout(connect=timeouts.connect_s, read=timeouts.decode_read_s,
                            write=timeouts.connect_s * 5, pool=timeouts.connect_s)
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


Chooser = Callable[[list[Pod]], Choice]


async def send_hop(client: httpx.AsyncClient, pods: PodDirectory, metrics: RouterMetrics,
                   hop: str, pool: str, choose: Chooser, path: str, body: bytes,
                   headers: dict[str, str], timeout: httpx.Timeout | None = None
                   ) -> HopResponse:
    """Sends `body` to a pod of `pool` chosen by `choose`; retries once on another pod."""
    tried: list[str] = []
    last_error = f"no live pod in the {pool} pool"
    for attempt in range(2):
        candidates = [p for p in pods.pool(pool) if p.name not in tried]
        if not candidates:
            break
        choice = choose(candidates)
        pod = choice.pod
        tried.append(pod.name)
        if attempt:
            metrics.retries.labels(hop).inc()
        answer, last_error = await _try_pod(client, pods, metrics, hop, choice, path, body,
                                            headers, timeout)
        if answer is not None:
            return answer
    if not tried:
        raise HopError(f"no pod can serve this request: the {pool} pool has no live pod",
                       status=503, code="service_unavailable")
    raise HopError(f"the {pool} pool could not serve this request: {last_error}")


async def _try_pod(client: httpx.AsyncClient, pods: PodDirectory, metrics: RouterMetrics,
                   hop: str, choice: Choice, path: str, body: bytes, headers: dict[str, str],
                   timeout: httpx.Timeout | None) -> tuple[HopResponse | None, str]:
    pod = choice.pod
    request = client.build_request("POST", pod.url + path, content=body, headers=headers,
                                   timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
    started = time.perf_counter()
    pod.num_routed += 1
    try:
        response = await client.send(request, stream=True)
    except httpx.TransportError as exc:
        pod.num_routed -= 1
        pods.mark_failed(pod)
        metrics.hop_requests.labels(hop, "unreachable").inc()
        return None, f"pod {pod.name} failed: {type(exc).__name__}: {exc}"
    metrics.hop_latency.labels(hop).observe(time.perf_counter() - started)
    if response.status_code in RETRYABLE_STATUSES:
        pod.num_routed -= 1
        detail = (await response.aread())[:300].decode(errors="replace")
        await response.aclose()
        if response.status_code >= 500:
            pods.mark_failed(pod)
        metrics.hop_requests.labels(hop, str(response.status_code)).inc()
        return None, f"pod {pod.name} answered {response.status_code}: {detail}"
    metrics.hop_requests.labels(hop, str(response.status_code)).inc()
    # The caller closes the response; `release` undoes num_routed then.
    response.extensions["kvferry_pod"] = pod
    return HopResponse(pod, response, choice), ""


def release(answer: HopResponse) -> None:
    """The answer is over: the pod no longer carries this request for this router."""
    answer.pod.num_routed -= 1
