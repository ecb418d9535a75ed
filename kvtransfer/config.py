"""Configuration of the KV transfer layer, validated on construction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from kvferry.kvtransfer.auth import KEY_ENV, SideChannelAuth, TransferKey, key_from_environment

# What a decode pod does when a pull fails: compute the prompt itself, or fail the request.
FailurePolicy = Literal["recompute", "fail"]
# NIXL's UCX backend parameter `ucx_error_handling_mode` (see nixl_backend.py for the choice).
UcxErrorMode = Literal["none", "peer"]
# The pod's part in disaggregation: a decode pod never holds blocks for another pod.
TransferRole = Literal["both", "prefill", "decode", "encoder"]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class KVTransferConfig:
    """How this engine ferries KV blocks to and from its peers."""

    # Names this engine to its peers; None draws a random id when the connector starts.
    engine_id: str | None = None
    # Identity of the weights served, compared at handshake: two engines exchange KV only
    # when they run the same model (a served model name, not a local path).
    model_id: str = ""
    # The KV host: the address the side channel binds to (and, through `ucx_net_devices`,
    # where UCX listens). One address of this machine, never a wildcard.
    side_channel_host: str = "127.0.0.1"
    # 0 picks a free port; the bound port is what the params advertise.
    side_channel_port: int = 0
    # Host written into `remote_host` of returned params, where peers reach the side channel
    # by another address than it binds (a NAT); None advertises `side_channel_host`.
    advertise_host: str | None = None
    # The network devices UCX may use (UCX_NET_DEVICES: the KV host's interface, then RDMA
    # devices; see interfaces.py); None leaves UCX every device, and a listener on each.
    ucx_net_devices: str | None = None
    # Seconds a producer holds a finished prefill's blocks without a pull or heartbeat.
    lease_s: float = 30.0
    # Seconds between a consumer's heartbeats; None takes a third of the lease.
    heartbeat_interval_s: float | None = None
    # Seconds a side-channel call (handshake, heartbeat, free) may wait for its answer once
    # connected, and seconds its connect may take: short, so a silent or slow producer
    # costs a consumer little (see pulls.py for the per-producer limit).
    side_channel_timeout_s: float = 3.0
    side_channel_connect_timeout_s: float = 1.0
    # Side-channel calls of pulls that may run at once towards one producer: a slow producer
    # holds at most this many of the consumer's preparation threads.
    max_prepares_per_producer: int = 2
    # Seconds a started pull may take before it is failed and cancelled.
    pull_timeout_s: float = 30.0
    failure_policy: FailurePolicy = "recompute"
    ucx_error_handling_mode: UcxErrorMode = "none"
    # A NIXL progress thread polls UCX without pause: on a CPU host it takes a core from
    # the model and, on 2 cores, made a 64 MB pull 4-6x slower. Without it, NIXL progresses
    # when the connector's transfer thread polls (every 1 ms while pulls run, every 10 ms
    # otherwise); on a GPU host with spare cores a progress thread lets completions land
    # between polls.
    nixl_progress_thread: bool = False
    # A pull of `read_split_min_bytes` or more is split into this many READs posted at once
    # from as many threads: one READ is one kernel copy on a CPU host, about half of what
    # two cores copy (see nixl_backend.py). 1 posts every pull as one READ.
    read_threads: int = 2
    read_split_min_bytes: int = 16 * 1024 * 1024
    # The service's shared secret: signs returned params and side-channel calls, and is
    # required of every params a consumer pulls with (auth.py). Never logged or printed.
    transfer_key: TransferKey | None = field(default=None, repr=False)
    # Transfers without a key: params unsigned and unchecked, the side channel open to
    # anyone who reaches it. Only where the network is trusted.
    insecure: bool = False
    role: TransferRole = "both"

    def __post_init__(self) -> None:
        _require(
            self.engine_id is None or bool(self.engine_id),
            "engine_id must be a non-empty string or None",
        )
        _require(
            0 <= self.side_channel_port <= 65535,
            f"side_channel_port must be in [0, 65535], got {self.side_channel_port}",
        )
        _require(self.lease_s > 0, f"lease_s must be > 0, got {self.lease_s}")
        _require(
            self.heartbeat_interval_s is None or 0 < self.heartbeat_interval_s < self.lease_s,
            f"heartbeat_interval_s must be in (0, lease_s={self.lease_s}), "
            f"got {self.heartbeat_interval_s}",
        )
        _require(
            self.side_channel_timeout_s > 0,
            f"side_channel_timeout_s must be > 0, got {self.side_channel_timeout_s}",
        )
        _require(
            self.side_channel_connect_timeout_s > 0,
            f"side_channel_connect_timeout_s must be > 0, got "
            f"{self.side_channel_connect_timeout_s}",
        )
        _require(self.max_prepares_per_producer >= 1,
                 f"max_prepares_per_producer must be >= 1, got {self.max_prepares_per_producer}")
        _require(self.pull_timeout_s > 0, f"pull_timeout_s must be > 0, got {self.pull_timeout_s}")
        _require(1 <= self.read_threads <= 16,
                 f"read_threads must be in [1, 16], got {self.read_threads}")
        _require(self.read_split_min_bytes >= 0,
                 f"read_split_min_bytes must be >= 0, got {self.read_split_min_bytes}")
        _require(
            self.failure_policy in ("recompute", "fail"),
            f"failure_policy must be recompute or fail, got {self.failure_policy!r}",
        )
        _require(
            self.ucx_error_handling_mode in ("none", "peer"),
            f"ucx_error_handling_mode must be none or peer, got {self.ucx_error_handling_mode!r}",
        )
        devices = self.ucx_net_devices
        _require(devices is None or (bool(devices) and not any(c.isspace() for c in devices)),
                 f"ucx_net_devices must be None or a comma-separated list of device names, "
                 f"got {devices!r}")
        _require(self.role in ("both", "prefill", "decode", "encoder"),
                 f"role must be both, prefill, decode or encoder, got {self.role!r}")
        _require(self.transfer_key is None or not self.insecure,
                 "transfer_key and insecure exclude each other: a keyed pod signs and checks "
                 "every transfer")

    @property
    def may_transfer(self) -> bool:
        """Whether transfers can run: with a key, or insecure by choice.

        A pod with neither starts no connector and refuses every kv_transfer_params.
        """
        return self.transfer_key is not None or self.insecure

    @property
    def heartbeat_s(self) -> float:
        """Seconds between heartbeats: three chances to renew before a lease ends."""
        return self.heartbeat_interval_s or self.lease_s / 3

    def require_may_transfer(self) -> None:
        """Raises ValueError unless a connector may run with this config."""
        if not self.may_transfer:
            raise ValueError("a KV connector needs the service's transfer_key (or insecure=True "
                             "to run without one)")

    def side_channel_auth(self) -> SideChannelAuth | None:
        """Signs and checks side-channel calls with the key; None for an insecure pod."""
        return None if self.transfer_key is None else SideChannelAuth(self.transfer_key)

    def key_for_child(self) -> tuple[KVTransferConfig, dict[str, str]]:
        """(this config without its key, the environment that carries the key).

        How a process hands the config to the engine-core process it starts: a command
        line is readable by every user of the machine, the environment is not.
        """
        if self.transfer_key is None:
            return self, {}
        return replace(self, transfer_key=None), {KEY_ENV: self.transfer_key.text}

    def with_key_from(self, environ: Mapping[str, str]) -> KVTransferConfig:
        """The config a child rebuilds: the key from `environ` (see key_for_child)."""
        key = None if self.insecure else key_from_environment(environ)
        return self if key is None else replace(self, transfer_key=key)
