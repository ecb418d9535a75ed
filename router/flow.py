"""A generation request's way through the pools: prefill -> decode (encoder-decoder models
take their own way, encode -> decode: encode.py).

The client sees one request. With a prefill pool, the prompt is first sent to a prefill pod
with `kv_transfer_params: {"do_remote_decode": true}`, one token and no streaming; the
params it returns go with the original request to a decode pod, which pulls the KV blocks
and answers (its answer holds the first token once and the whole request's usage). The
prefill hop is skipped when the decode pod would compute only a short uncached part of
the prompt itself (the prompt is short, or the decode pod the decode policy picks holds all
but a short tail of it by the router's prefix index, whatever that policy), for requests that are not one prompt with n == 1 (a prefill pod hands
over the KV of one sequence), and when the prefill pool is down or fails (counted as a
fallback). A prefill pod that refuses the request itself (a 4xx other than 429) ends it:
the client gets that answer, as the decode pod would give it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from kvferry.router.config import RouterSettings
from kvferry.router.hops import (
    TRANSPORT_ERRORS,
    Chooser,
    HopError,
    HopResponse,
    make_client,
    release,
    send_hop,
)
from kvferry.router.kv_events import KVEventReader
from kvferry.router.metrics import RouterMetrics
from kvferry.router.pod_client import HopTimeout, PodClient
from kvferry.router.pods import Pod, PodDirectory
from kvferry.router.policies import Choice, Policy, PrefixAware, RoundRobin, make_policy
from kvferry.router.prefix_index import PrefixIndex, prompt_block_hashes

from kvferry.protocol.block_hash import hash_request_blocks
from kvferry.protocol.errors import error_body
from kvferry.protocol.prompt_embeds import (
    PLACEHOLDER_TOKEN_ID,
    PromptEmbedsError,
    decode_prompt_embeds,
    embeds_salt,
)
from kvferry.protocol.record_auth import Rejection
from kvferry.protocol.request_checks import (
    InvalidRequest,
    check_body,
    check_prompt_inputs,
    known_fields,
)
from kvferry.protocol.request_fields import COMPLETIONS, UnknownFields, unknown_names

if TYPE_CHECKING:
    from kvferry.engine.frontend.tokenizer import Tokenizer

logger = logging.getLogger("kvferry.router")

# A client may not steer KV transfer: the router sets this field itself, or drops it.
KV_TRANSFER_FIELD = "kv_transfer_params"
TOKENIZE_TIMEOUT_S = 10.0
# Threads that run the router's tokenizer. Never the event loop: a long text takes seconds to
# tokenize (the tokenizer releases the GIL meanwhile), and every other request would wait.
TOKENIZE_THREADS = 2


@dataclass
class Prompt:
    """What the router knows of a request's prompt before choosing pods. A /v1/completions
    batch (several prompts in one request) is judged by its first prompt; the pod it goes to
    computes and caches every one of them."""

    token_ids: list[int] | None  # None: not tokenized (no policy needs it)
    block_hashes: list[bytes] | None  # the engine's hashes of its full blocks
    # The block hashes of every prompt of the request, block_hashes first.
    batch_hashes: list[list[bytes]] = field(default_factory=list)


@dataclass
class Answer:
    """What goes back to the client: a whole body, or a stream of SSE chunks."""

    status: int
    headers: dict[str, str]
    body: bytes | None = None
    chunks: AsyncGenerator[bytes, None] | None = None


class RequestRefused(Exception):
    """A pod found the request itself invalid: `answer` (its own status and body) goes to
    the client as it is, and no other pod is tried."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(f"refused with {answer.status}")
        self.answer = answer


class Router:
    """Shared by the routes: pods, policies, the prefix index, metrics and the HTTP client."""

    def __init__(self, settings: RouterSettings, tokenizer: Tokenizer | None = None) -> None:
        self.settings = settings
        # The engines' tokenizer, when the router was given it: text prompts are tokenized
        # here, without a /tokenize round trip to a pod.
        self.tokenizer = tokenizer
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS,
                                                 thread_name_prefix="kvferry-tokenize")
        self.metrics = RouterMetrics()
        self.unknown_fields = UnknownFields("kvferry router")
        key = settings.registry_key
        self.pods = PodDirectory(settings.redis_url, settings.service, settings.registry_poll_s,
                                 key, self._count_rejected, settings.pod_grace_s,
                                 self._count_dropped)
        self.index = PrefixIndex()
        # Cross-attention blocks of encoder-decoder models, apart from the prompt prefixes.
        self.cross_index = PrefixIndex()
        self.kv_events = KVEventReader(settings.redis_url, settings.service, self.index, key,
                                       self._count_rejected, self.cross_index)
        self.pods.on_leave.append(self.index.forget_pod)
        self.pods.on_leave.append(self.cross_index.forget_pod)
        self.metrics.kv_events.set_function(lambda: self.kv_events.num_events)
        self.metrics.pods_late.set_function(lambda: self.pods.num_late)
        self.policies = {pool: make_policy(name, self.index)
                         for pool, name in settings.policies.items()}
        self.client = make_client(settings.timeouts)
        self.pod_client = PodClient(settings.max_pod_connections)
        self.metrics.connection_waits.set_function(lambda: self.pod_client.num_waiting)
        timeouts = settings.timeouts
        self.decode_timeout = HopTimeout(connect_s=timeouts.connect_s,
                                         read_s=timeouts.decode_read_s)
        self.prefill_timeout = HopTimeout(connect_s=timeouts.connect_s,
                                           total_s=timeouts.prefill_s)
        # The threads that hash an uploaded file (as long a job as tokenizing a long text).
        self.hash_pool = self._tokenize_pool
        from kvferry.router.encode import EncodeFlow

        # Encoder-decoder models: the encode hop, and the routes that take it.
        self.encode = EncodeFlow(self, self.cross_index)

    def _count_rejected(self, why: Rejection) -> None:
        self.metrics.registry_rejected.labels(why.value).inc()

    def _count_dropped(self, pool: str, reason: str) -> None:
        self.metrics.pods_dropped.labels(pool, reason).inc()

    async def start(self) -> None:
        self.pods.start()
        # The prefix index serves prefix-aware policies and, whatever the policies, the
        # prefill skip for a prompt the chosen decode pod holds already.
        self.kv_events.start()

    async def stop(self) -> None:
        await self.kv_events.stop()
        await self.pods.stop()
        await self.client.close()
        await self.pod_client.close()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the whole request
    async def generate(self, endpoint: str, body: dict[str, Any], request_id: str,
                       raw: bytes | None = None) -> Answer:
        """Runs one /v1/completions or /v1/chat/completions request through the pools.
        `raw` is the body as the client sent it: the decode pod gets it unchanged unless the
        router had to drop or add transfer params (saving a serialization per request).
        InvalidRequest: the body has text or a field type the engine pods refuse (the router
        refuses it the same way, before tokenizing it or spending a prefill hop on it)."""
        check_body(endpoint, body)
        if endpoint == COMPLETIONS:
            check_prompt_inputs(body.get("prompt"), body.get("prompt_embeds"))
        unknown = unknown_names(endpoint, body, known_fields(endpoint))
        if unknown:
            self.unknown_fields.record(endpoint, unknown)
            self.metrics.unknown_request_fields.inc(len(unknown))
        if KV_TRANSFER_FIELD in body:
            del body[KV_TRANSFER_FIELD]
            raw = None
        if self.encode.encoder_input():
            return await self.encode.generate(endpoint, body, request_id)
        prompt = await self._prompt(endpoint, body)
        decode = self._cache_choice(prompt)
        try:
            params = await self._maybe_prefill(endpoint, body, prompt, decode, request_id)
        except RequestRefused as refused:
            return refused.answer
        if params is not None:
            body = {**body, KV_TRANSFER_FIELD: params}
            raw = None
            # Loads seen before the prefill hop are stale by now (requests that came
            # meanwhile saw the same ones): the decode pod is chosen when the hop goes,
            # except by round robin, whose turn was taken already and holds.
            if not isinstance(self._policy("decode"), RoundRobin):
                decode = None
        payload = raw if raw is not None else dumps(body)
        return await self._decode(endpoint, payload, prompt, decode, request_id)

    # ------------------------------------------------------------------ choosing pods
    def _cache_choice(self, prompt: Prompt) -> Choice | None:
        """The decode pod the decode policy picks for the prompt, with the prompt tokens the
        prefix index says it holds already (which may make the prefill hop unneeded); None
        for an empty pool or a prompt without block hashes. Counted as chosen only if used.

        Whatever the policy, the skip is judged on the pod the request would go to: a
        prefix-aware policy predicts its own hits; for the others the index is asked about
        the pod they picked."""
        policy = self._policy("decode")
        pods = self.pods.pool("decode")
        if not pods or not prompt.block_hashes:
            return None
        choice = policy.choose(pods, prompt.block_hashes)
        if isinstance(policy, PrefixAware):
            return choice
        pod = choice.pod
        held = self.index.num_leading_blocks(prompt.block_hashes, [pod.name])[pod.name]
        return Choice(pod, held * pod.record.block_size)

    def _policy(self, pool: str) -> Policy:
        return self.policies.get(pool) or self.policies["decode"]

    def count_choice(self, pool: str, choice: Choice) -> None:
        self.metrics.pod_chosen.labels(pool, self._policy(pool).name, choice.pod.name).inc()
        if choice.predicted_hit_tokens:
            self.metrics.predicted_hit_tokens.labels(pool).inc(choice.predicted_hit_tokens)

    def chooser(self, pool: str, prompt: Prompt, first: Choice | None) -> Chooser:
        """Hands out `first` once, then policy choices among the pods not tried yet."""
        pending = [first] if first is not None else []

        def choose(candidates: list[Pod]) -> Choice:
            if pending and pending[0].pod in candidates:
                choice = pending.pop()
            else:
                pending.clear()
                choice = self._policy(pool).choose(candidates, prompt.block_hashes)
            self.count_choice(pool, choice)
            return choice

        return choose

    # ------------------------------------------------------------------ the prompt
    def _needs_tokens(self) -> bool:
        has_prefill = bool(self.pods.pool("prefill"))
        prefix_decode = self.settings.policies.get("decode") == "prefix-aware"
        return has_prefill or prefix_decode

    async def _prompt(self, endpoint: str, body: dict[str, Any]) -> Prompt:
        if not self._needs_tokens():
            return Prompt(None, None)
        payloads = _given_embeds(endpoint, body)
        if payloads is not None:
            return await self._embeds_prompt(payloads)
        batch = given_token_ids(endpoint, body)
        if batch is None:  # text or chat messages: the engine's tokenizer says
            token_ids = await self.tokenize(endpoint, body)
            batch = [token_ids] if token_ids is not None else None
        if batch is None:
            return Prompt(None, None)
        block_size = self._block_size()
        hashes = _batch_block_hashes(batch, block_size) if block_size else None
        if hashes is None:
            return Prompt(batch[0], None)
        return Prompt(batch[0], hashes[0], hashes)

    async def _embeds_prompt(self, payloads: list[str]) -> Prompt:
        """A prompt given as embeddings, as the pods will key its blocks: placeholder ids
        hashed with the embeddings' hash. Decoded on a tokenizer thread, with the pods'
        checks that need no model (a payload they would refuse for its width or values
        still goes to a pod, which says why). InvalidRequest for a payload refused here."""
        pods = self.pods.pool("decode") or self.pods.pool("prefill")
        max_rows = (pods[0].record.max_model_len or None) if pods else None
        loop = asyncio.get_running_loop()
        try:
            decoded = await loop.run_in_executor(
                self._tokenize_pool, _decode_embeds, payloads, max_rows,
                self.settings.max_embeds_body_bytes)
        except PromptEmbedsError as exc:
            raise InvalidRequest(str(exc), param="prompt_embeds") from None
        block_size = self._block_size()
        placeholders = [[PLACEHOLDER_TOKEN_ID] * num_rows for num_rows, _ in decoded]
        if not block_size:
            return Prompt(placeholders[0], None)
        hashes = [hash_request_blocks(ids, block_size, [], salt)
                  for ids, (_, salt) in zip(placeholders, decoded)]
        return Prompt(placeholders[0], hashes[0], hashes)

    def _block_size(self) -> int | None:
        pods = self.pods.pool("decode") or self.pods.pool("prefill")
        return pods[0].record.block_size if pods else None

    async def tokenize(self, endpoint: str, body: dict[str, Any],
                       max_tokens: int | None = None) -> list[int] | None:
        """The prompt's token ids: from the router's own copy of the engines' tokenizer when
        it has one and the prompt is one text, else from a pod's /tokenize (the engine's own
        tokenizer and chat template); None when the prompt is neither, or is a text that
        cannot fit the pods' `max_tokens` (default max_model_len; the engine judges: it
        refuses such a text from its length alone, at once, where tokenizing it would take
        seconds)."""
        pods = self.pods.pool("decode") or self.pods.pool("prefill")
        query = _tokenize_query(endpoint, body)
        if query is not None and pods and pods[0].record.cannot_fit(_num_text_chars(query),
                                                                     max_tokens):
            return None
        if self.tokenizer is not None:
            token_ids = await self._local_token_ids(endpoint, body)
            if token_ids is not None:
                self.metrics.tokenized.labels("router").inc()
                return token_ids
        if query is None or not pods:
            return None
        pod = min(pods, key=lambda p: p.num_routed)
        self.metrics.tokenized.labels("pod").inc()
        try:
            async with self.client.post(pod.url + "/tokenize", json=query,
                                        timeout=aiohttp.ClientTimeout(TOKENIZE_TIMEOUT_S)) as r:
                if r.status != 200:
                    return None  # the engine gives the client the same 400 on the real hop
                tokens = (await r.json()).get("tokens")
        except (*TRANSPORT_ERRORS, ValueError) as exc:
            logger.warning("tokenize on %s failed: %s", pod.name, exc)
            return None
        return tokens if isinstance(tokens, list) else None

    async def _local_token_ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """`_local_token_ids` on a tokenizer thread."""
        assert self.tokenizer is not None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, _local_token_ids,
                                          self.tokenizer, endpoint, body)

    # ------------------------------------------------------------------ prefill
    async def _maybe_prefill(self, endpoint: str, body: dict[str, Any], prompt: Prompt,
                             decode: Choice | None, request_id: str) -> dict[str, Any] | None:
        """Runs the prefill hop when it pays; its kv_transfer_params, or None to let the
        decode pod compute the prompt itself."""
        if not self.pods.pool("prefill"):
            if "prefill" in self.pods.seen_pools:
                self.metrics.prefill_fallbacks.labels("no_live_prefill_pod").inc()
            return None
        if not is_one_prompt(endpoint, body):
            self.metrics.prefill_skips.labels("not_one_prompt").inc()
            return None
        if _scores_the_prompt(body):
            self.metrics.prefill_skips.labels("prompt_logprobs").inc()
            return None
        if self._is_short(prompt, None):
            self.metrics.prefill_skips.labels("short_prompt").inc()
            return None
        if self._is_short(prompt, decode):
            self.metrics.prefill_skips.labels("cached_on_decode").inc()
            return None
        try:
            return await self._prefill(endpoint, body, prompt, request_id)
        except HopError as exc:
            logger.warning("request %s: prefill failed, decoding without it: %s", request_id, exc)
            self.metrics.prefill_fallbacks.labels("prefill_failed").inc()
            return None

    def _is_short(self, prompt: Prompt, decode: Choice | None) -> bool:
        if prompt.token_ids is None:
            return False
        cached = decode.predicted_hit_tokens if decode is not None else 0
        return len(prompt.token_ids) - cached < self.settings.prefill_threshold_tokens

    async def _prefill(self, endpoint: str, body: dict[str, Any], prompt: Prompt,
                       request_id: str) -> dict[str, Any] | None:
        prefill_body = {**body, KV_TRANSFER_FIELD: {"do_remote_decode": True}, "max_tokens": 1,
                        "stream": False}
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        answer = await send_hop(self.pod_client, self.pods, self.metrics, "prefill", "prefill",
                                self.chooser("prefill", prompt, None), endpoint,
                                dumps(prefill_body), hop_headers(request_id),
                                self.prefill_timeout)
        try:
            raw = await answer.response.read()
        except TRANSPORT_ERRORS as exc:
            raise HopError(f"prefill pod {answer.pod.name} failed mid-answer: {exc}") from None
        finally:
            release(answer)
        raise_if_refused(answer, raw)
        self._remember(answer.pod.name, prompt)
        if answer.response.status != 200:
            raise HopError(f"prefill pod {answer.pod.name} answered "
                           f"{answer.response.status}: {raw[:200]!r}")
        params = json.loads(raw).get(KV_TRANSFER_FIELD)
        if not isinstance(params, dict):
            raise HopError(f"prefill pod {answer.pod.name} returned no {KV_TRANSFER_FIELD}")
        return params

    # ------------------------------------------------------------------ decode
    async def _decode(self, endpoint: str, payload: bytes, prompt: Prompt,
                      first: Choice | None, request_id: str) -> Answer:
        answer = await send_hop(self.pod_client, self.pods, self.metrics, "decode", "decode",
                                self.chooser("decode", prompt, first), endpoint, payload,
                                hop_headers(request_id), self.decode_timeout)
        self._remember(answer.pod.name, prompt)
        return await self.relay(answer)

    async def relay_raw(self, endpoint: str, raw: bytes, request_id: str) -> Answer:
        """Plain proxying (one `both` pool, nothing to choose by prompt): the body as sent."""
        answer = await send_hop(self.pod_client, self.pods, self.metrics, "decode", "decode",
                                self.chooser("decode", Prompt(None, None), None), endpoint, raw,
                                hop_headers(request_id), self.decode_timeout)
        return await self.relay(answer)

    def can_relay_raw(self, raw: bytes) -> bool:
        """True when the body can go to a decode pod untouched (the fast path). Never with a
        prefill pool, even one that is down: that request is a fallback, and is counted; nor
        with an encoder pool, or a decode policy looking for cross blocks, for an
        encoder-decoder model."""
        if KV_TRANSFER_FIELD.encode() in raw or "prefill" in self.pods.seen_pools:
            return False
        if self.encode.encoder_input():
            return not self.encode.needs_key()
        return not self._needs_tokens()

    async def transcribe(self, content_type: str, body: bytearray, request_id: str) -> Answer:
        """Runs one /v1/audio/transcriptions form (held once, in `body`) through the pools."""
        return await self.encode.transcribe(content_type, body, request_id)

    async def relay(self, answer: HopResponse) -> Answer:
        response = answer.response
        headers = {"content-type": response.headers.get("content-type", "application/json")}
        if not headers["content-type"].startswith("text/event-stream"):
            try:
                body = await response.read()
            except TRANSPORT_ERRORS as exc:
                raise HopError(f"decode pod {answer.pod.name} failed mid-answer: {exc}") from None
            finally:
                release(answer)
            return Answer(response.status, headers, body=body)
        return Answer(response.status, headers, chunks=self._stream(answer))

    async def _stream(self, answer: HopResponse) -> AsyncGenerator[bytes, None]:
        """The decode pod's SSE chunks as they come; an error event if it dies mid-way."""
        try:
            if answer.first_chunk:
                yield answer.first_chunk
            async for chunk in answer.response.iter_chunks():
                yield chunk
        except TRANSPORT_ERRORS as exc:
            self.metrics.stream_errors.inc()
            logger.warning("decode pod %s failed mid-stream: %s", answer.pod.name, exc)
            error = error_body(502, f"the decode pod failed mid-answer: {type(exc).__name__}",
                               code="bad_gateway")
            yield b"data: " + dumps(error) + b"\n\ndata: [DONE]\n\n"
        finally:
            release(answer)

    def _remember(self, pod: str, prompt: Prompt) -> None:
        """The pod that computed this request's prompts now caches their full blocks."""
        for hashes in prompt.batch_hashes:
            if hashes:
                self.index.stored(pod, hashes)


def raise_if_refused(answer: HopResponse, raw: bytes) -> None:
    """RequestRefused for a 4xx other than 429: the request is wrong (model, length, types,
    max_tokens ...), and the decode pod would refuse it the same way."""
    status = answer.response.status
    if 400 <= status < 500 and status != 429:
        content_type = answer.response.headers.get("content-type", "application/json")
        raise RequestRefused(Answer(status, {"content-type": content_type}, body=raw))


def _scores_the_prompt(body: dict[str, Any]) -> bool:
    """True for a request that asks for its prompt's logprobs (`prompt_logprobs`, or `echo`
    with `logprobs`): they need every prompt position computed on the pod that answers."""
    if body.get("prompt_logprobs") is not None:
        return True
    return body.get("echo") is True and body.get("logprobs") is not None


def is_one_prompt(endpoint: str, body: dict[str, Any]) -> bool:
    """True for a request with one prompt (a text, token ids, or a one-element list of
    either; chat messages) and n == 1: the only kind a prefill pod hands over. Batches, n > 1
    and malformed prompts go to the decode pod, which computes (or refuses) them itself."""
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        return False
    if endpoint.endswith("/chat/completions"):
        return True
    embeds = body.get("prompt_embeds")
    if embeds is not None:
        return isinstance(embeds, str) or (isinstance(embeds, list) and len(embeds) == 1)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and bool(prompt) and _is_token_ids(prompt)


def _given_embeds(endpoint: str, body: dict[str, Any]) -> list[str] | None:
    """The base64 payloads of a /v1/completions request's prompt_embeds, one per prompt;
    None without them (check_body made sure of their types)."""
    embeds = body.get("prompt_embeds") if endpoint == COMPLETIONS else None
    if embeds is None:
        return None
    return [embeds] if isinstance(embeds, str) else list(embeds) or None


def _decode_embeds(payloads: list[str], max_rows: int | None,
                   max_bytes: int) -> list[tuple[int, bytes]]:
    """(rows, salt) of each payload, decoded as the pods decode it; runs on a thread."""
    where = (["prompt_embeds"] if len(payloads) == 1
             else [f"prompt_embeds[{i}]" for i in range(len(payloads))])
    decoded = []
    for text, name in zip(payloads, where):
        tensor = decode_prompt_embeds(text, None, max_rows, max_bytes, where=name)
        decoded.append((int(tensor.shape[0]), embeds_salt(tensor)))
    return decoded


def given_token_ids(endpoint: str, body: dict[str, Any]) -> list[list[int]] | None:
    """The prompts of a /v1/completions request given as token ids, one list per prompt: a
    list of ids is one prompt, a list of such lists a batch. None for anything else (text,
    chat, a malformed prompt: the engine answers those)."""
    if endpoint.endswith("/chat/completions"):
        return None
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None
    if _is_token_ids(prompt):
        return [prompt]
    if all(isinstance(p, list) and p and _is_token_ids(p) for p in prompt):
        return prompt
    return None


def _is_token_ids(values: list[Any]) -> bool:
    return all(type(t) is int for t in values)  # not bool, which JSON's true/false become


def _batch_block_hashes(batch: list[list[int]], block_size: int) -> list[list[bytes]] | None:
    """Each prompt's block hashes; None when an id does not fit the engine's int64 (the
    engine refuses the request, so there is nothing to route by)."""
    try:
        return [prompt_block_hashes(token_ids, block_size) for token_ids in batch]
    except OverflowError:
        return None


def _local_token_ids(tokenizer: Tokenizer, endpoint: str, body: dict[str, Any]
                     ) -> list[int] | None:
    """A /v1/completions text prompt's ids exactly as the engine encodes it; None for chat
    (its template and options are the engine's) and for anything but one text. Runs on a
    tokenizer thread (`encode_in_thread`, which lets the event loop run meanwhile)."""
    if endpoint.endswith("/chat/completions"):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    add_special_tokens = body.get("add_special_tokens", True)
    if not isinstance(prompt, str) or not isinstance(add_special_tokens, bool):
        return None
    return tokenizer.encode_in_thread(prompt, add_special_tokens=add_special_tokens)


def load_tokenizer(source: str) -> Tokenizer:
    """The tokenizer of a checkpoint directory (or `demo`), as the engine loads it;
    ValueError says why it cannot be loaded."""
    from kvferry.engine.frontend.tokenizer import Tokenizer
    from kvferry.engine.models.source import resolve_model_source

    try:
        return Tokenizer.from_pretrained(resolve_model_source(source))
    except ValueError:
        raise
    except Exception as exc:  # the tokenizers library raises plain Exceptions
        raise ValueError(f"cannot load a tokenizer from {source}: {exc}") from None


def _tokenize_query(endpoint: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The /tokenize body for the request's one text prompt or chat messages, or None."""
    model = body.get("model")
    if endpoint.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        query = {"model": model, "messages": messages}
        # The chat template renders the tools too (the pod's /tokenize takes them).
        if isinstance(body.get("tools"), list) and body["tools"]:
            query["tools"] = body["tools"]
        return query
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    if body.get("add_special_tokens") is False:  # the pods encode the text without them
        return {"model": model, "prompt": prompt, "add_special_tokens": False}
    return {"model": model, "prompt": prompt}


def _num_text_chars(query: dict[str, Any]) -> int:
    """The characters of a /tokenize query's text: its prompt, or its messages' contents (the
    rendered conversation is longer, by the template's own text; a template that dropped a
    message would only cost the request its routing by prefix)."""
    prompt = query.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    total = 0
    for message in query.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return total


def hop_headers(request_id: str) -> dict[str, str]:
    return {"content-type": "application/json", "x-request-id": request_id}


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
