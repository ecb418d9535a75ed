"""The pod registry in Redis: where each engine pod announces itself and its load.

Each pod owns one key, `kvferry:<service>:pod:<pod>`, holding a JSON `PodRecord`. The key
has a short TTL that the pod refreshes, so a pod that dies without a word disappears from
the registry within one TTL (the router keeps it for a grace period more, unless connecting
to it fails: a late record is not yet a dead pod). A pod that stops cleanly replaces its
record by one with `is_leaving` set, which the router drops at once, and lets it expire.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass

# A record not refreshed for this long expires; the pod refreshes it several times per TTL,
# from a thread that a busy event loop does not hold up.
REGISTRY_TTL_S = 3.0


# The variable every kvferry command reads the service's Redis URL from when no flag gives
# it, and the name the pods and the router read before (still read, with a warning).
REDIS_URL_ENV = "KVFERRY_REDIS_URL"
DEPRECATED_REDIS_URL_ENV = "REDIS_URL"


def redis_url_from_environment(environ: Mapping[str, str]) -> str | None:
    """$KVFERRY_REDIS_URL, else $REDIS_URL (with a deprecation warning), else None."""
    url = environ.get(REDIS_URL_ENV, "").strip()
    if url:
        return url
    url = environ.get(DEPRECATED_REDIS_URL_ENV, "").strip()
    if not url:
        return None
    logging.getLogger("kvferry").warning(
        "$%s is deprecated and will stop being read: set $%s instead",
        DEPRECATED_REDIS_URL_ENV, REDIS_URL_ENV)
    return url


def pod_key_prefix(service: str) -> str:
    """Keys of every pod of `service` start with this."""
    return f"kvferry:{service}:pod:"


@dataclass(frozen=True)
class PodRecord:
    """What the router knows of one engine pod (the JSON value of its registry key)."""

    pod: str  # unique name of the pod (its hostname in Kubernetes)
    service: str  # the InferenceService it serves
    role: str  # both | prefill | decode | encoder
    model: str  # the served model name clients send
    url: str  # base URL of its OpenAI server, e.g. http://10.0.0.7:8000
    block_size: int  # tokens per KV block (the router hashes prompts with it)
    num_running: int  # requests the scheduler runs now
    num_waiting: int  # requests queued for the scheduler
    kv_cache_usage: float  # fraction of KV blocks in use, 0.0 - 1.0
    updated_at: float  # time.time() of this record
    # The longest prompt plus output, in tokens (0: not announced).
    max_model_len: int = 0
    # The most characters one token of the pod's tokenizer covers (0: not announced). With
    # max_model_len it proves a text too long from its length alone, before tokenizing.
    max_token_chars: int = 0
    # HMAC of every other field with the service's KV transfer key (record_auth.py); None
    # from a pod without a key.
    mac: str | None = None
    # The pod's last record: it is stopping (draining or dead) and takes no new requests.
    is_leaving: bool = False
    # Encoder-decoder models: what the encoder reads ("tokens": BART's text, "audio":
    # Whisper's), "" for a decoder-only model; and the longest encoder input in positions
    # (0: decoder-only). The router learns from them that a service's requests take an
    # encode hop and how to key their encoder input (block_hash.encoder_input_key).
    encoder_input: str = ""
    max_encoder_len: int = 0

    @property
    def is_encoder_decoder(self) -> bool:
        return bool(self.encoder_input)

    def cannot_fit(self, num_chars: int, max_tokens: int | None = None) -> bool:
        """True when a text of `num_chars` characters (or more) needs more tokens than
        `max_tokens` (default max_model_len; an encoder text's is max_encoder_len): the pod
        refuses it before tokenizing it, and so nothing should tokenize it for the pod."""
        limit = self.max_model_len if max_tokens is None else max_tokens
        if not limit or not self.max_token_chars:
            return False
        return -(-num_chars // self.max_token_chars) > limit

    def to_json(self) -> str:
        fields = asdict(self)
        if self.mac is None:  # what a pod without a key published before records had MACs
            del fields["mac"]
        if not self.is_leaving:  # a live pod's record reads as it did before the field
            del fields["is_leaving"]
        if not self.encoder_input:  # a decoder-only pod's record reads as before the fields
            del fields["encoder_input"], fields["max_encoder_len"]
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> PodRecord:
        """Parses a registry value; ValueError when it is not a pod record.

        The field values are not checked here: see `record_auth.check_record`.
        """
        try:
            fields = json.loads(raw)
            if not isinstance(fields, dict):
                raise TypeError("not a JSON object")
            return cls(**fields)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a pod record: {exc}") from None
