"""Sending one hop of a request to a pod, with one retry on another pod of the same pool.

A hop is retried when its pod refuses the connection, times out before answering, answers
429/5xx, or drops a stream before its first chunk: in each case the client has seen nothing
yet. Once a whole answer's headers, or a stream's first chunk, are in, the router is
committed to that pod. A pod no connection can be opened to leaves the router's view at
once; one that failed otherwise is set aside for a while.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from kvferry.router.config import HopTimeouts
from kvferry.router.metrics import RouterMetrics
from kvferry.router.pod_client import Body, HopTimeout, PodClient, PodResponse, PodUnreachable
from kvferry.router.pods import Pod, PodDirectory
from kvferry.router.policies import Choice

# Statuses that mean "this pod cannot take it now", not "this request is wrong".
RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
# Of those, the ones a pod answers without having acted on the request (busy, or not
# serving: loading or draining).
TURNED_AWAY_STATUSES = frozenset({429, 503})


class HopError(Exception):
    """A hop failed on every pod it was tried on; `status` is what the client gets.

    `pod_error`: the last pod's own error body (an OpenAI error object, as it sent it) when
    that pod answered with one; the client gets it unchanged, with the pod's status.
    `untaken`: no pod acted on the request (each turned it away with 429/503, refused the
    connection, or there was none), so nothing it names was used.
    """

    def __init__(self, message: str, status: int = 502, code: str = "bad_gateway",
                 pod_error: bytes | None = None, untaken: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.pod_error = pod_error
        self.untaken = untaken


@dataclass(frozen=True)
class _Failure:
    """Why one pod did not take the hop."""

    message: str
    # The pod's answer, when it gave one in OpenAI's error shape: its status and body.
    status: int | None = None
    body: bytes | None = None
    # The pod never acted on the request (see HopError.untaken).
    untaken: bool = False


@dataclass
class HopResponse:
    """An answer whose headers are in; `response` may still be streaming its body."""

    pod: Pod
    response: PodResponse
    choice: Choice
    # A stream's first bytes, read before committing to the pod (b"" for a whole answer).
    first_chunk: bytes = b""


# What a pod that is down or stuck raises: refused/reset connections, timeouts.
TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


def make_client(timeouts: HopTimeouts) -> aiohttp.ClientSession:
    """One pooled client for the pods' other endpoints (/tokenize, /v1/models, ...): keep-alive
    connections, no global request limit. The hops themselves go through `PodClient`."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s,
                                    sock_read=timeouts.decode_read_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                 skip_auto_headers=("User-Agent",))


Chooser = Callable[[list[Pod]], Choice]


async def send_hop(client: PodClient, pods: PodDirectory, metrics: RouterMetrics,
                   hop: str, pool: str, choose: Chooser, path: str, body: Body,
                   headers: dict[str, str], timeout: HopTimeout) -> HopResponse:
    """Sends `body` to a pod of `pool` chosen by `choose`; retries once on another pod."""
    tried: list[str] = []
    failure = _Failure(f"no live pod in the {pool} pool", untaken=True)
    untaken = True
    for attempt in range(2):
        candidates = [p for p in pods.pool(pool) if p.name not in tried]
        if not candidates:
            break
        choice = choose(candidates)
        pod = choice.pod
        tried.append(pod.name)
        if attempt:
            metrics.retries.labels(hop).inc()
        answer = await _try_pod(client, pods, metrics, hop, choice, path, body, headers, timeout)
        if isinstance(answer, HopResponse):
            return answer
        failure = answer
        untaken = untaken and failure.untaken
    if not tried:
        raise HopError(f"no pod can serve this request: the {pool} pool has no live pod",
                       status=503, code="service_unavailable", untaken=True)
    message = f"the {pool} pool could not serve this request: {failure.message}"
    if failure.body is not None and failure.status is not None:
        raise HopError(message, status=failure.status, pod_error=failure.body,
                       untaken=untaken)
    raise HopError(message, untaken=untaken)


async def _try_pod(client: PodClient, pods: PodDirectory, metrics: RouterMetrics,
                   hop: str, choice: Choice, path: str, body: Body, headers: dict[str, str],
                   timeout: HopTimeout) -> HopResponse | _Failure:
    pod = choice.pod
    started = time.perf_counter()
    pod.num_routed += 1
    try:
        response = await client.post(pod.url, path, body, headers, timeout)
    except TRANSPORT_ERRORS as exc:
        pod.num_routed -= 1
        if isinstance(exc, PodUnreachable):
            pods.drop_unreachable(pod)
        else:
            pods.mark_failed(pod)
        metrics.hop_requests.labels(hop, "unreachable").inc()
        return _Failure(f"pod {pod.name} failed: {type(exc).__name__}: {exc}",
                        untaken=isinstance(exc, PodUnreachable))
    metrics.hop_latency.labels(hop).observe(time.perf_counter() - started)
    if response.status in RETRYABLE_STATUSES:
        pod.num_routed -= 1
        try:
            raw: bytes | None = await response.read()
        except TRANSPORT_ERRORS as exc:
            raw, detail = None, f"(body lost: {type(exc).__name__})"
        response.release()
        if response.status >= 500:
            pods.mark_failed(pod)
        metrics.hop_requests.labels(hop, str(response.status)).inc()
        untaken = response.status in TURNED_AWAY_STATUSES
        if raw is not None and is_error_object(raw):
            return _Failure(f"pod {pod.name} answered {response.status}", response.status, raw,
                            untaken)
        if raw is not None:
            detail = raw[:300].decode(errors="replace")
        return _Failure(f"pod {pod.name} answered {response.status}: {detail}",
                        untaken=untaken)
    try:
        first_chunk = await _first_chunk(response)
    except TRANSPORT_ERRORS as exc:
        response.release()
        pod.num_routed -= 1
        pods.mark_failed(pod)
        metrics.hop_requests.labels(hop, "unreachable").inc()
        return _Failure(f"pod {pod.name} failed before its first chunk: "
                        f"{type(exc).__name__}: {exc}")
    metrics.hop_requests.labels(hop, str(response.status)).inc()
    # The caller releases the response, and `release` undoes num_routed then.
    return HopResponse(pod, response, choice, first_chunk)


def is_error_object(raw: bytes) -> bool:
    """Whether a pod's body is an OpenAI error object (`{"error": {"message": ...}}`), which
    the client may get as it is."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return (isinstance(body, dict) and isinstance(body.get("error"), dict)
            and isinstance(body["error"].get("message"), str))


async def _first_chunk(response: PodResponse) -> bytes:
    """A stream's first bytes; b"" for a whole answer.

    An engine sends a stream's headers as soon as it takes the request, then nothing until
    the first token: a pod that dies while the request waits in its queue or pulls its KV
    must cost a retry on another pod, not the client's answer.
    """
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return b""
    return await response.read_chunk()


def release(answer: HopResponse) -> None:
    """The answer is over: the pod no longer carries this request for this router."""
    answer.response.release()
    answer.pod.num_routed -= 1
