"""The router's settings, from its command line and the environment the operator renders."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvferry.http_limits import HttpLimits
from kvferry.kvtransfer.auth import TransferKey

POLICIES = ("round-robin", "least-loaded", "prefix-aware")
POOLS = ("encoder", "prefill", "decode")
DEFAULT_POLICIES = {"encoder": "least-loaded", "prefill": "prefix-aware", "decode": "least-loaded"}
# On SIGTERM, seconds in-flight requests get to finish: the engine pods' default drain, so a
# request the router holds may run as long as the pod serving it is allowed to.
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# How long a pod whose registry record is missing stays routable. Its record expires
# REGISTRY_TTL_S after its last refresh, so a pod that vanished without a word (and is never
# refused a connection, which drops it at once) is chosen for up to the sum of the two.
DEFAULT_POD_GRACE_S = 5.0
# Connections the router opens to one pod at most; hops beyond wait for one to come free.
# The engines' default max_num_seqs is 256, and a pod that already runs that many queues the
# rest anyway: 512 leaves it a visible waiting queue (the autoscaler's signal) as deep again.
DEFAULT_MAX_POD_CONNECTIONS = 512
# The most bytes of a transcription upload (OpenAI's limit, and the pods' default).
DEFAULT_MAX_AUDIO_BODY_BYTES = 25 * 1024 * 1024


@dataclass(frozen=True)
class HopTimeouts:
    """Seconds each hop may take, so the router never hangs a client on a stuck pod."""

    connect_s: float = 2.0  # opening a connection to a pod
    prefill_s: float = 120.0  # the whole prefill hop (one token)
    # Between two chunks of a decode answer (and before its headers).
    decode_read_s: float = 120.0
    encode_s: float = 120.0  # the whole encode hop (encoder-decoder models)

    def __post_init__(self) -> None:
        for name in ("connect_s", "prefill_s", "decode_read_s", "encode_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HopTimeouts.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class RouterSettings:
    """What `kvferry router` runs with."""

    service: str  # the InferenceService whose pods it finds in Redis
    redis_url: str
    host: str = "127.0.0.1"
    port: int = 8000
    # Accepted `Authorization: Bearer` keys; empty: no key needed.
    api_keys: frozenset[str] = frozenset()
    # pool -> policy (round-robin | least-loaded | prefix-aware)
    policies: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_POLICIES))
    # Skip the prefill hop when fewer prompt tokens than this are not cached on the decode pod.
    prefill_threshold_tokens: int = 256
    max_body_bytes: int = 8 * 1024 * 1024
    # The larger limit of a /v1/completions body carrying prompt_embeds (base64 of a
    # torch.save payload: 4/3 of the embeddings' bytes). The router decodes such a payload
    # (kvferry.protocol.prompt_embeds) to route by its hash, and relays it to both hops.
    max_embeds_body_bytes: int = 32 * 1024 * 1024
    # The most bytes of a /v1/audio/transcriptions body (the form with its audio file): the
    # pods' own --max-audio-body-bytes default, OpenAI's 25 MiB. The router holds an upload
    # once, to send it to the encode hop and the decode hop (and a retry) from that copy.
    max_audio_body_bytes: int = DEFAULT_MAX_AUDIO_BODY_BYTES
    timeouts: HopTimeouts = field(default_factory=HopTimeouts)
    # How often the router rereads the pod registry.
    registry_poll_s: float = 0.25
    # How long a pod whose registry record is missing stays routable.
    pod_grace_s: float = DEFAULT_POD_GRACE_S
    # The most connections open to one pod; hops beyond wait for one.
    max_pod_connections: int = DEFAULT_MAX_POD_CONNECTIONS
    uvicorn_log_level: str = "warning"
    # The engines' tokenizer (a checkpoint directory or `demo`): text completion prompts are
    # tokenized in the router instead of by a pod's /tokenize. None: always ask a pod.
    tokenizer: str | None = None
    # On SIGTERM, how long in-flight requests may still run before they are cut.
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # Header, body and idle timeouts, and the most open client connections.
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    # The service's KV transfer key: pod records and KV events must verify with it. None
    # (an insecure setup) takes unsigned ones; out-of-range values are refused either way.
    registry_key: TransferKey | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for pool, policy in self.policies.items():
            if pool not in POOLS:
                raise ValueError(f"routing: unknown pool {pool!r}; pools are {', '.join(POOLS)}")
            if policy not in POLICIES:
                raise ValueError(f"KVFERRY_ROUTING_{pool.upper()} must be one of "
                                 f"{', '.join(POLICIES)}, got {policy!r}")
        if self.prefill_threshold_tokens < 0:
            raise ValueError(f"--prefill-threshold must be >= 0, got "
                             f"{self.prefill_threshold_tokens}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")
        if not self.pod_grace_s >= 0:
            raise ValueError(f"--pod-grace must be >= 0, got {self.pod_grace_s}")
        if self.max_pod_connections < 1:
            raise ValueError(f"--max-pod-connections must be >= 1, got "
                             f"{self.max_pod_connections}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_embeds_body_bytes < 1024:
            raise ValueError(f"--max-embeds-body-bytes must be >= 1024, got "
                             f"{self.max_embeds_body_bytes}")
        if self.max_audio_body_bytes < 1024:
            raise ValueError(f"--max-audio-body-bytes must be >= 1024, got "
                             f"{self.max_audio_body_bytes}")


def policies_from_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Per-pool policies: KVFERRY_ROUTING_<POOL> where set, the CRD's defaults elsewhere."""
    policies = dict(DEFAULT_POLICIES)
    for pool in POOLS:
        value = environ.get(f"KVFERRY_ROUTING_{pool.upper()}")
        if value:
            policies[pool] = value
    return policies


def read_api_keys(path: str) -> frozenset[str]:
    """Keys from a file: one per line (a Secret holding one key is a one-line file)."""
    with open(path, encoding="utf-8") as f:
        keys = frozenset(line.strip() for line in f if line.strip())
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key")
    return keys
