"""The transfer key and what it signs: transfer params and side-channel calls.

Every pod of a service shares one key (a Secret under the operator, one per run under
`kvferry up`, a file or $KVFERRY_KV_TRANSFER_KEY for a bare `kvferry serve`). With it:

- a producer signs the params it returns: `kvferry_mac` is an HMAC-SHA256 over a canonical
  encoding of every field a consumer acts on, `kvferry_expires_at` included. A consumer
  checks it before it dials anything the params name, so forged params cause no connection
  at all (no handshake, heartbeat or free to the address they name);
- every side-channel request carries a signature over its method, path, body, a timestamp
  and a nonce. The producer refuses one outside the skew window or seen before, and signs
  its reply, bound to the request's nonce, so a listener without the key can neither read
  a producer's handshake nor pass for one.

The key never appears in a log line, a repr or an error body.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import msgspec
from kvferry.kvtransfer.metrics import FailureReason
from kvferry.kvtransfer.params import KVTransferParams

# The environment variable a pod reads its key from (other tools and tests set it too).
KEY_ENV = "KVFERRY_KV_TRANSFER_KEY"
# HMAC-SHA256 keys shorter than its 32-byte output weaken it.
MIN_KEY_BYTES = 32
# Seconds a consumer's clock may run ahead of the producer's that signed params.
PARAMS_CLOCK_SKEW_S = 10.0
# Seconds a side-channel request's timestamp may differ from the producer's clock.
SIDE_CHANNEL_SKEW_S = 30.0
# The header that carries a side-channel request's or reply's signature.
SIGNATURE_HEADER = "X-Kvferry-Signature"
# Domain tags: a MAC made for one kind of message never verifies as another.
_PARAMS_TAG = b"kvferry-params/v1"
_REQUEST_TAG = b"kvferry-side-channel-request/v1"
_REPLY_TAG = b"kvferry-side-channel-reply/v1"
_HOW_TO_GENERATE = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def generate_key_text() -> str:
    """A fresh random key as text (32 random bytes, URL-safe base64: 43 characters)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class TransferKey:
    """The secret every pod of one service shares; `repr` never shows it."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_KEY_BYTES:
            raise ValueError(
                f"a KV transfer key needs at least {MIN_KEY_BYTES} bytes, this one has "
                f"{len(self.secret)}; generate one with {_HOW_TO_GENERATE}")

    @classmethod
    def from_text(cls, text: str, source: str) -> TransferKey:
        """The key in `text` (surrounding whitespace dropped: files end with a newline).

        `source` names where it came from in the error (a flag and path, or a variable).
        """
        stripped = text.strip()
        if not stripped:
            raise ValueError(f"{source} holds no KV transfer key (it is empty)")
        try:
            return cls(stripped.encode())
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    @property
    def text(self) -> str:
        """The key as the text it was given in (keys are text: files, variables)."""
        return self.secret.decode()

    def mac(self, *parts: object) -> str:
        """HMAC-SHA256 (hex) of `parts`, encoded without ambiguity (msgpack of the list)."""
        return hmac.new(self.secret, msgspec.msgpack.encode(parts), hashlib.sha256).hexdigest()

    def verifies(self, mac: str, *parts: object) -> bool:
        """Whether `mac` is this key's MAC of `parts` (compared in constant time)."""
        return hmac.compare_digest(mac.encode(), self.mac(*parts).encode())


def key_from_environment(environ: Mapping[str, str]) -> TransferKey | None:
    """$KVFERRY_KV_TRANSFER_KEY as a key; None when unset or empty."""
    text = environ.get(KEY_ENV, "")
    return TransferKey.from_text(text, f"${KEY_ENV}") if text else None


# ---------------------------------------------------------------------------- params
def _signed_fields(params: KVTransferParams) -> tuple[object, ...]:
    """Every field a consumer acts on, in a fixed order and type.

    Values are normalized as the parser normalizes them (block ids per group, the lease as
    a float), so params that went through JSON and a router verify as they were signed.
    """
    lease = None if params.kvferry_lease_s is None else float(params.kvferry_lease_s)
    return (
        # `do_remote_decode` asks the engine given the params to hold what it computes; it
        # names nothing to contact. Signed as False (what a producer returns), so a router
        # may add it: a prefill pod then pulls an encoder pod's hold and holds the result.
        _PARAMS_TAG, False, params.do_remote_prefill,
        params.remote_engine_id, params.remote_host, params.remote_port,
        [list(group) for group in params.remote_block_ids], params.remote_request_id,
        params.kvferry_agent_name, params.kvferry_num_tokens, lease,
        params.kvferry_protocol_version, params.kvferry_prompt_hash, params.kvferry_expires_at,
        # Encoder holds only: params without them sign exactly as before the fields existed.
        *((params.kvferry_encoder_hash, params.kvferry_num_encoder_tokens)
          if params.kvferry_encoder_hash is not None
          or params.kvferry_num_encoder_tokens is not None else ()),
    )


def sign_params(params: KVTransferParams, key: TransferKey, now: float) -> KVTransferParams:
    """`params` with an expiry one lease from `now` and their MAC.

    After its lease the producer has freed the blocks anyway, so older params name nothing.
    """
    lease_s = params.kvferry_lease_s or 0.0
    unsigned = replace(params, kvferry_expires_at=math.ceil(now + lease_s), kvferry_mac=None)
    return replace(unsigned, kvferry_mac=key.mac(*_signed_fields(unsigned)))


@dataclass(frozen=True)
class ParamsRefusal:
    """Why signed params were refused: a failure reason (a metric label) and a message."""

    reason: FailureReason
    message: str


def check_params(params: KVTransferParams, key: TransferKey, now: float) -> ParamsRefusal | None:
    """None when the params were signed with `key` and have not expired."""
    if params.kvferry_mac is None:
        return ParamsRefusal(FailureReason.BAD_SIGNATURE,
                             "kv_transfer_params carry no kvferry_mac: they were not returned by "
                             "a prefill pod of this service")
    if not key.verifies(params.kvferry_mac, *_signed_fields(params)):
        return ParamsRefusal(FailureReason.BAD_SIGNATURE,
                             "kv_transfer_params.kvferry_mac does not match: the params were "
                             "changed, or signed with another service's KV transfer key")
    expires_at = params.kvferry_expires_at
    if expires_at is None or now > expires_at + PARAMS_CLOCK_SKEW_S:
        return ParamsRefusal(FailureReason.PARAMS_EXPIRED,
                             f"kv_transfer_params expired at {expires_at} (unix time), "
                             f"{now - (expires_at or 0):.0f} s ago: the producer has freed "
                             "the blocks they name")
    return None


# ---------------------------------------------------------------------------- side channel
class SideChannelAuth:
    """Signs and checks side-channel requests and replies with the service's key."""

    def __init__(self, key: TransferKey, skew_s: float = SIDE_CHANNEL_SKEW_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._key = key
        self.skew_s = skew_s
        self._clock = clock
        self._lock = threading.Lock()
        # Nonces of accepted requests, until they are too old to pass the skew check anyway.
        self._seen: set[str] = set()
        self._seen_order: deque[tuple[float, str]] = deque()

    # ------------------------------------------------------------------ client side
    def sign_request(self, method: str, path: str, body: bytes) -> tuple[str, str]:
        """(header value, nonce) for one request; the nonce checks the reply."""
        timestamp = str(int(self._clock()))
        nonce = secrets.token_hex(16)
        mac = self._key.mac(_REQUEST_TAG, method, path, timestamp, nonce, _digest(body))
        return f"t={timestamp},n={nonce},mac={mac}", nonce

    def reply_verifies(self, nonce: str, status: int, body: bytes, header: str | None) -> bool:
        """Whether a reply was signed with the key for the request of `nonce`."""
        fields = _parse_header(header)
        mac = fields.get("mac")
        return mac is not None and self._key.verifies(mac, _REPLY_TAG, nonce, status,
                                                      _digest(body))

    # ------------------------------------------------------------------ server side
    def check_request(self, method: str, path: str, body: bytes,
                      header: str | None) -> tuple[str | None, str | None]:
        """(nonce, None) for a request to serve; (None, why) for one to refuse.

        Refused: no or a malformed signature, a MAC that does not verify, a timestamp
        outside the skew window, or a nonce already seen (a replay).
        """
        fields = _parse_header(header)
        timestamp, nonce, mac = fields.get("t"), fields.get("n"), fields.get("mac")
        if timestamp is None or nonce is None or mac is None or not timestamp.isdigit():
            return None, f"the request carries no valid {SIGNATURE_HEADER} header"
        if not self._key.verifies(mac, _REQUEST_TAG, method, path, timestamp, nonce,
                                  _digest(body)):
            return None, "the request's signature does not verify with this service's key"
        now = self._clock()
        if abs(now - int(timestamp)) > self.skew_s:
            return None, f"the request was signed more than {self.skew_s:.0f} s from now"
        if not self._remember(nonce, now):
            return None, "the request was already served (a replay)"
        return nonce, None

    def sign_reply(self, nonce: str, status: int, body: bytes) -> str:
        return f"mac={self._key.mac(_REPLY_TAG, nonce, status, _digest(body))}"

    def _remember(self, nonce: str, now: float) -> bool:
        """False when the nonce was seen within the window; else records it."""
        with self._lock:
            # A request older than the window fails the timestamp check, so its nonce can go.
            while self._seen_order and self._seen_order[0][0] < now:
                self._seen.discard(self._seen_order.popleft()[1])
            if nonce in self._seen:
                return False
            self._seen.add(nonce)
            self._seen_order.append((now + 2 * self.skew_s, nonce))
            return True


def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _parse_header(header: str | None) -> dict[str, str]:
    """`t=1,n=ab,mac=cd` -> {"t": "1", "n": "ab", "mac": "cd"}; {} when absent."""
    if not header:
        return {}
    fields = {}
    for part in header.split(","):
        name, sep, value = part.strip().partition("=")
        if sep:
            fields[name] = value
    return fields
