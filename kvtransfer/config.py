"""Configuration of the KV transfer layer, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# What a decode pod does when a pull fails: compute the prompt itself, or fail the request.
FailurePolicy = Literal["recompute", "fail"]
# NIXL's UCX backend parameter `ucx_error_handling_mode` (see nixl_backend.py for the choice).
UcxErrorMode = Literal["none", "peer"]


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
    # Address the producer's side channel binds to.
    side_channel_host: str = "127.0.0.1"
    # 0 picks a free port; the bound port is what the params advertise.
    side_channel_port: int = 0
    # Host written into `remote_host` of returned params (a pod IP when binding 0.0.0.0);
    # None advertises `side_channel_host`.
    advertise_host: str | None = None
    # Seconds a producer holds a finished prefill's blocks without a pull or heartbeat.
    lease_s: float = 30.0
    # Seconds between a consumer's heartbeats; None takes a third of the lease.
    heartbeat_interval_s: float | None = None
    # Seconds a side-channel call (handshake, heartbeat, free) may take.
    side_channel_timeout_s: float = 5.0
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

    @property
    def heartbeat_s(self) -> float:
        """Seconds between heartbeats: three chances to renew before a lease ends."""
        return self.heartbeat_interval_s or self.lease_s / 3
