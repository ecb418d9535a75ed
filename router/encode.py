"""The way of a request to an encoder-decoder model (BART, Whisper): encode -> decode.

With an encoder pool, the request goes first to an encoder pod as the client sent it, plus
`kv_transfer_params: {"do_remote_decode": true}` (a JSON field, or a form field holding that
JSON for a transcription's multipart form). The encoder pod runs only the encoder, holds the
request's cross-attention blocks under a lease and answers with the params naming them; the
request then goes to a decode pod with those params, and the decode pod pulls the blocks,
runs the short decoder prompt and decodes.

The prefill pool is used for these models only when the decoder prompt is long (as long as
the prefill threshold): a transcription whose `prompt` (Whisper's previous text) makes it
so. The request then goes encoder -> prefill -> decode: the prefill pod is sent the encoder
pod's params with `do_remote_decode` added, pulls the cross blocks, computes the decoder
prompt and holds both; the decode pod pulls both. Without an encoder hop (no encoder pool,
or it failed) the prefill pod runs the encoder itself. A completion's decoder prompt is the
model's default, a few tokens: it never takes the prefill hop.

The encode hop is skipped when the decode pod the decode policy picks holds the encoder
input's first cross-attention block already (the KV events' cross-block hashes, in an index
of their own), and for requests that are not one prompt with n == 1 (the decode pod encodes
those itself). When the encoder pool has no live pod, turns the hop away or fails it, the
request goes straight to decode, whose pod runs the encoder itself: counted by reason.

The encoder input's key (kvferry.protocol.block_hash) is what the pods key cross blocks by:
a token encoder's prompt ids (tokenized as the pods tokenize it), or for an uploaded audio
file the sha256 of its bytes (`"audio-file"`), never decoded here.

Which services take this way: those whose pods' registry records name an encoder input
(`PodRecord.encoder_input`, from each pod's engine), not the service spec, so a router
needs no configuration of its own for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvferry.router.flow import (
    KV_TRANSFER_FIELD,
    Answer,
    Prompt,
    RequestRefused,
    dumps,
    given_token_ids,
    hop_headers,
    is_one_prompt,
    raise_if_refused,
)
from kvferry.router.hops import TRANSPORT_ERRORS, Chooser, HopError, release, send_hop
from kvferry.router.multipart import Form, FormError, form_boundary, parse_form
from kvferry.router.pod_client import Body, HopTimeout
from kvferry.router.pods import Pod
from kvferry.router.policies import Choice, RoundRobin, make_policy
from kvferry.router.prefix_index import PrefixIndex

from kvferry.protocol.block_hash import (
    encoder_input_key,
    encoder_token_payload,
    hash_cross_blocks,
)
from kvferry.protocol.request_fields import COMPLETIONS

if TYPE_CHECKING:
    from kvferry.router.flow import Router

logger = logging.getLogger("kvferry.router")

AUDIO_PATH = "/v1/audio/transcriptions"
# What the encoder pod is asked for: run the encoder, hold the cross blocks for a decode pod.
ENCODE_PARAMS = {"do_remote_decode": True}
# Whisper's decoder prompt before its previous text: start of previous, start of
# transcript, language, task, no timestamps.
WHISPER_TASK_TOKENS = 5
# Statuses an encoder pod turns a hop away with when it is busy (429) or not serving (503:
# loading or draining); anything else that is not the request's own fault is a failure.
REFUSED_STATUSES = frozenset({429, 503})


@dataclass
class EncoderRequest:
    """A request to an encoder-decoder model, as each of its hops sends it."""

    endpoint: str
    headers: dict[str, str]
    # The hash of the encoder input's first cross-attention block; None when the router
    # cannot key the input (or nothing it does needs the key).
    first_cross_hash: bytes | None
    # Why the request goes straight to decode whatever the pools hold (a metric label).
    skip_reason: str | None
    # The body of a hop that holds what it computes (the encode and prefill hops): the
    # client's request, answered whole, with these params.
    hold_body: Callable[[dict[str, Any]], Body]
    # The decode hop's body with the encoder pod's params; without any for None.
    decode_body: Callable[[dict[str, Any] | None], Body]
    # The decoder prompt's tokens (at most), when it may be long enough for the prefill
    # pool; None: the model's default decoder prompt, always short.
    decoder_tokens: int | None = None


def first_cross_hash(kind: str, payload: bytes) -> bytes:
    """The hash of the first cross-attention block of an encoder input (`kind` and
    `payload` as `encoder_input_key` takes them): what a decode pod holding the input's
    cross blocks has published."""
    return hash_cross_blocks(encoder_input_key(kind, payload), 1)[0]


class EncodeFlow:
    """The router's routes for encoder-decoder models: the JSON completions and the
    transcription form, through the encode hop when it pays."""

    def __init__(self, router: Router, cross_index: PrefixIndex) -> None:
        self.router = router
        # Which decode pod holds which encoder input's cross blocks (from the KV events).
        self.cross_index = cross_index
        # The decode pool's policy, judging pods by the cross blocks they hold (a
        # prefix-aware one prefers the pod holding the input's first cross block).
        self.cross_policy = make_policy(router.settings.policies["decode"], cross_index)
        timeouts = router.settings.timeouts
        self._timeout = HopTimeout(connect_s=timeouts.connect_s, total_s=timeouts.encode_s)

    # ------------------------------------------------------------------ the service
    def encoder_input(self) -> str:
        """What the service's encoder reads ("tokens" or "audio") by its pods' records; ""
        for a decoder-only model (and before any pod has registered)."""
        pods = self.router.pods
        for pool in ("decode", "encoder"):
            live = pods.pool(pool)
            if live:
                return live[0].record.encoder_input
        return ""

    def needs_key(self) -> bool:
        """Whether anything uses the encoder input's key: an encoder pool's hop to skip, or
        a decode policy that looks for the pod holding the cross blocks."""
        return ("encoder" in self.router.pods.seen_pools
                or self.cross_policy.name == "prefix-aware")

    # ------------------------------------------------------------------ the routes
    async def generate(self, endpoint: str, body: dict[str, Any], request_id: str) -> Answer:
        """A /v1/completions (or chat) request, its prompt being the encoder's input."""
        is_one = endpoint == COMPLETIONS and is_one_prompt(endpoint, body)
        key = await self._tokens_cross_hash(endpoint, body) if is_one and self.needs_key() \
            else None
        request = EncoderRequest(
            endpoint, hop_headers(request_id), key, None if is_one else "not_one_prompt",
            hold_body=lambda params: dumps(_hold_json(body, params)),
            decode_body=lambda params: dumps(
                body if params is None else {**body, KV_TRANSFER_FIELD: params}))
        return await self._run(request, request_id)

    async def transcribe(self, content_type: str, body: bytearray, request_id: str) -> Answer:
        """A /v1/audio/transcriptions form, held once in `body`: each hop sends views of it.

        A body that is not a multipart form, and any form for a model that does not take
        audio, goes to a decode pod as it is (without a client's kv_transfer_params), which
        answers it as it does on its own."""
        headers = {"content-type": content_type, "x-request-id": request_id}
        try:
            boundary = form_boundary(content_type)
            form = parse_form(body, boundary) if boundary is not None else None
        except FormError as exc:
            logger.info("request %s: relaying a transcription form the router cannot read "
                        "to a decode pod: %s", request_id, exc)
            form = None
        if form is None:
            request = EncoderRequest(AUDIO_PATH, headers, None, None, lambda _: [body],
                                     lambda _: [body])
            return await self._decode(request, None, None, request_id)
        without_params = form.with_field(KV_TRANSFER_FIELD, None)
        request = EncoderRequest(
            AUDIO_PATH, headers, None, None,
            hold_body=lambda params: form.with_field(KV_TRANSFER_FIELD, dumps(params)),
            decode_body=lambda params: without_params if params is None
            else form.with_field(KV_TRANSFER_FIELD, dumps(params)))
        if self.encoder_input() != "audio":
            return await self._decode(request, None, None, request_id)
        if "prefill" in self.router.pods.seen_pools:
            request.decoder_tokens = await self._decoder_tokens(form)
        file = form.part("file")
        if file is not None and self.needs_key():
            # Hashing megabytes takes milliseconds: on a thread (hashlib lets go of the GIL).
            loop = asyncio.get_running_loop()
            digest = await loop.run_in_executor(self.router.hash_pool, _sha256,
                                                form.content(file))
            request.first_cross_hash = first_cross_hash("audio-file", digest)
        return await self._run(request, request_id)

    # ------------------------------------------------------------------ the hops
    async def _run(self, request: EncoderRequest, request_id: str) -> Answer:
        decode, holds = self._decode_choice(request.first_cross_hash)
        try:
            params = await self._maybe_encode(request, holds, request_id)
            params = await self._maybe_prefill(request, params, holds, request_id)
        except RequestRefused as refused:  # the decode pod would refuse it the same way
            return refused.answer
        # Loads seen before the encode hop are stale by now: the decode pod is chosen when
        # the hop goes, except by round robin, whose turn was taken already.
        if params is not None and not isinstance(self.cross_policy, RoundRobin):
            decode = None
        return await self._decode(request, params, decode, request_id)

    def _decode_choice(self, first_hash: bytes | None) -> tuple[Choice | None, bool]:
        """The decode pod the policy picks, and whether it holds the input's first cross
        block by the index (whatever the policy: the skip is judged on the pod the request
        goes to). Counted as chosen only if used."""
        pods = self.router.pods.pool("decode")
        if not pods:
            return None, False
        pod = self.cross_policy.choose(pods, [first_hash] if first_hash else None).pod
        if first_hash is None:
            return Choice(pod), False
        held = self.cross_index.num_leading_blocks([first_hash], [pod.name])[pod.name]
        return Choice(pod), held > 0

    async def _maybe_encode(self, request: EncoderRequest, holds: bool,
                            request_id: str) -> dict[str, Any] | None:
        """Runs the encode hop when it pays; its kv_transfer_params, or None to let the
        decode pod run the encoder itself."""
        metrics = self.router.metrics
        if not self.router.pods.pool("encoder"):
            if "encoder" in self.router.pods.seen_pools:
                metrics.encode_fallbacks.labels("no_live_encoder_pod").inc()
            return None
        if request.skip_reason is not None:
            metrics.encode_skips.labels(request.skip_reason).inc()
            return None
        if holds:
            metrics.encode_skips.labels("cached_on_decode").inc()
            return None
        try:
            params = await self._encode(request)
        except HopError as exc:
            reason = "encoder_refused" if exc.status in REFUSED_STATUSES else "encoder_failed"
            logger.warning("request %s: encode hop failed (%s), decoding without it: %s",
                           request_id, reason, exc)
            metrics.encode_fallbacks.labels(reason).inc()
            return None
        metrics.encode_hops.labels(request.endpoint).inc()
        return params

    async def _maybe_prefill(self, request: EncoderRequest, params: dict[str, Any] | None,
                             holds: bool, request_id: str) -> dict[str, Any] | None:
        """Runs the prefill hop of a long decoder prompt; the params for the decode hop (the
        prefill pod's, or `params` when the hop is skipped)."""
        router = self.router
        metrics = router.metrics
        if "prefill" not in router.pods.seen_pools:
            return params
        if request.decoder_tokens is None:
            metrics.prefill_skips.labels("encoder_decoder").inc()
            return params
        if request.decoder_tokens < router.settings.prefill_threshold_tokens:
            metrics.prefill_skips.labels("short_prompt").inc()
            return params
        if holds:
            metrics.prefill_skips.labels("cached_on_decode").inc()
            return params
        if not router.pods.pool("prefill"):
            metrics.prefill_fallbacks.labels("no_live_prefill_pod").inc()
            return params
        try:
            return await self._hold_hop(request, "prefill", "prefill",
                                        {**(params or {}), "do_remote_decode": True},
                                        router.prefill_timeout)
        except HopError as exc:
            logger.warning("request %s: prefill hop failed, decoding without it: %s",
                           request_id, exc)
            metrics.prefill_fallbacks.labels("prefill_failed").inc()
            # Pods that all turned the hop away pulled nothing: the encoder's hold still
            # stands. One that took it may have pulled it: the decode pod encodes itself.
            return params if exc.untaken else None

    async def _encode(self, request: EncoderRequest) -> dict[str, Any]:
        """The encoder pod's kv_transfer_params; HopError when no pod gave them,
        RequestRefused when the pod found the request itself wrong (the client gets that)."""
        return await self._hold_hop(request, "encode", "encoder", ENCODE_PARAMS, self._timeout)

    async def _hold_hop(self, request: EncoderRequest, hop: str, pool: str,
                        params: dict[str, Any], timeout: HopTimeout) -> dict[str, Any]:
        """Sends the request to a pod of `pool` asking it to hold what it computes; the
        params naming the hold. HopError when no pod gave them, RequestRefused when the pod
        found the request itself wrong (the client gets that)."""
        router = self.router
        chooser = router.chooser(pool, Prompt(None, None), None)
        answer = await send_hop(router.pod_client, router.pods, router.metrics, hop, pool,
                                chooser, request.endpoint, request.hold_body(params),
                                request.headers, timeout)
        try:
            raw = await answer.response.read()
        except TRANSPORT_ERRORS as exc:
            raise HopError(f"{pool} pod {answer.pod.name} failed mid-answer: {exc}") from None
        finally:
            release(answer)
        raise_if_refused(answer, raw)
        if answer.response.status != 200:
            raise HopError(f"{pool} pod {answer.pod.name} answered "
                           f"{answer.response.status}: {raw[:200]!r}",
                           status=answer.response.status)
        return _held_params(answer.pod, raw)

    async def _decode(self, request: EncoderRequest, params: dict[str, Any] | None,
                      first: Choice | None, request_id: str) -> Answer:
        router = self.router
        answer = await send_hop(router.pod_client, router.pods, router.metrics, "decode",
                                "decode", self._decode_chooser(request.first_cross_hash, first),
                                request.endpoint, request.decode_body(params), request.headers,
                                router.decode_timeout)
        return await router.relay(answer)

    def _decode_chooser(self, first_hash: bytes | None, first: Choice | None) -> Chooser:
        """Hands out `first` once, then the policy's choices among the pods not tried."""
        pending = [first] if first is not None else []
        hashes = [first_hash] if first_hash else None

        def choose(candidates: list[Pod]) -> Choice:
            if pending and pending[0].pod in candidates:
                choice = pending.pop()
            else:
                pending.clear()
                choice = Choice(self.cross_policy.choose(candidates, hashes).pod)
            self.router.count_choice("decode", choice)
            return choice

        return choose

    async def _decoder_tokens(self, form: Form) -> int | None:
        """At most how many tokens a transcription's decoder prompt has: Whisper's task
        tokens and its previous text (`prompt`). A text is tokenized only when its bytes
        (each token is at least one) could reach the prefill threshold."""
        part = form.part("prompt")
        text = "" if part is None else bytes(form.content(part)).decode("utf-8", "replace")
        if not text.strip():
            return WHISPER_TASK_TOKENS
        text = " " + text.strip()
        num_bytes = len(text.encode())
        if num_bytes + WHISPER_TASK_TOKENS < self.router.settings.prefill_threshold_tokens:
            return num_bytes + WHISPER_TASK_TOKENS
        model_part = form.part("model")
        model = None if model_part is None else bytes(form.content(model_part)).decode(
            "utf-8", "replace")
        token_ids = await self.router.tokenize(
            COMPLETIONS, {"model": model, "prompt": text, "add_special_tokens": False})
        return None if token_ids is None else len(token_ids) + WHISPER_TASK_TOKENS

    # ------------------------------------------------------------------ the key
    async def _tokens_cross_hash(self, endpoint: str, body: dict[str, Any]) -> bytes | None:
        """The first cross block's hash of a token encoder's prompt (one prompt: ids as
        given, or a text tokenized as the pods tokenize it); None when it cannot be had."""
        if self.encoder_input() != "tokens":
            return None
        batch = given_token_ids(endpoint, body)
        if batch is not None:
            token_ids: list[int] | None = batch[0]
        else:
            pods = self.router.pods.pool("decode")
            limit = pods[0].record.max_encoder_len if pods else None
            token_ids = await self.router.tokenize(endpoint, body, limit)
        if not token_ids:
            return None
        try:
            payload = encoder_token_payload(token_ids)
        except (OverflowError, TypeError):  # not int64 ids: the pods refuse the request
            return None
        return first_cross_hash("tokens", payload)


def _hold_json(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A holding hop's JSON body: the client's, with `params`, answered whole."""
    out = {**body, KV_TRANSFER_FIELD: params, "stream": False}
    out.pop("stream_options", None)
    return out


def _held_params(pod: Pod, raw: bytes) -> dict[str, Any]:
    """The kv_transfer_params of a holding pod's answer; HopError when it has none."""
    try:
        answer = json.loads(raw)
    except (ValueError, RecursionError):
        raise HopError(f"{pod.pool} pod {pod.name} answered with a body that is not JSON: "
                       f"{raw[:200]!r}") from None
    params = answer.get(KV_TRANSFER_FIELD) if isinstance(answer, dict) else None
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        raise HopError(f"{pod.pool} pod {pod.name} returned no {KV_TRANSFER_FIELD} naming "
                       "the blocks it holds")
    return params


def _sha256(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()
