"""NIXL: one agent per engine, its KV caches registered once, reads by block runs.

Each block group's cache tensor is registered once, as one region: blocks are outermost,
so any run of consecutive block ids is one byte range inside it, and a pull needs one
descriptor per run (see `layout.block_runs`), not one per block and layer.

Transport choice. NIXL's UCX backend takes `ucx_error_handling_mode`: "peer" (its default)
asks UCX for transports that detect a failed peer; UCX's shared-memory transports
(posix, sysv) cannot, so on one host UCX falls back to TCP over loopback for the active
messages (wire-up, and the notification that completes a READ), while "none" keeps shared
memory for them. The bulk bytes go by CMA (process_vm_readv) either way, but a 2 MiB pull
through the connector took 8.3 ms under "peer" against 4.7 ms under "none"
(benchmarks/kvtransfer.py). kvferry defaults to "none" because it needs no transport-level
peer detection: every pull has a deadline (`pull_timeout_s`), the side channel's calls time
out, and a dead producer still fails a read at once (CMA errors when the peer is gone; see
the killed-producer tests). "peer" stays available in `KVTransferConfig` for networks where
it matters.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from kvferry.kvtransfer.layout import RegionInfo, run_descriptors

logger = logging.getLogger(__name__)


def _nixl() -> tuple[Any, Any, tuple[type[Exception], ...]]:
    """NIXL's agent classes and its exception types, imported only when a connector starts."""
    try:
        from nixl_cu12 import _bindings
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise ImportError(
            "KV transfer needs NIXL: pip install 'kvferry[kvtransfer]' (nixl-cu12)"
        ) from e
    names = [n for n in dir(_bindings) if n.startswith("nixl") and n.endswith("Error")]
    errors = tuple(getattr(_bindings, n) for n in names)
    return nixl_agent, nixl_agent_config, errors


class NixlError(Exception):
    """NIXL refused or failed an operation."""


@dataclass
class GroupRead:
    """The part of one pull that reads one block group."""

    local: RegionInfo
    remote: RegionInfo
    block_bytes: int
    # (num_runs, 3) rows (local_start, remote_start, num_blocks) from `block_runs`.
    runs: np.ndarray


@dataclass
class Transfer:
    """A started read."""

    handle: Any
    num_bytes: int
    num_descriptors: int
    started_at: float


class NixlBackend:
    """One engine's NIXL agent."""

    def __init__(
        self, agent_name: str, ucx_error_handling_mode: str = "none", progress_thread: bool = False
    ) -> None:
        nixl_agent, nixl_agent_config, self._errors = _nixl()
        self.agent_name = agent_name
        # No backend from the config: its UCX backend cannot take parameters there.
        config = nixl_agent_config(backends=[], enable_prog_thread=progress_thread)
        self._agent = nixl_agent(agent_name, config)
        self._agent.create_backend("UCX", {"ucx_error_handling_mode": ucx_error_handling_mode})
        # Registered regions by base address, so a tensor shared by two groups counts once.
        self._registered: dict[int, Any] = {}

    def register(self, tensor: Any) -> RegionInfo:
        """Registers a contiguous cache tensor (once) and says where it lives."""
        base = tensor.data_ptr()
        if base not in self._registered:
            self._registered[base] = self._call(self._agent.register_memory, tensor)
        on_gpu = tensor.device.type == "cuda"
        return RegionInfo(
            base_addr=base,
            num_blocks=tensor.shape[0],
            device_id=(tensor.device.index or 0) if on_gpu else 0,
            mem_type="VRAM" if on_gpu else "DRAM",
        )

    @property
    def metadata(self) -> bytes:
        """This agent's metadata, for the side channel to serve."""
        return self._agent.get_agent_metadata()

    def add_remote(self, metadata: bytes) -> str:
        """Loads a producer's metadata; returns its agent name."""
        return self._call(self._agent.add_remote_agent, metadata)

    def remove_remote(self, agent_name: str) -> None:
        """Forgets a producer (restarted or gone); best effort, it may already be gone."""
        try:
            self._agent.remove_remote_agent(agent_name)
        except self._errors as e:
            logger.debug("removing NIXL agent %s: %s", agent_name, e)

    def read(self, remote_agent: str, reads: list[GroupRead], notif: bytes) -> Transfer:
        """Starts one READ of every group's runs; the producer gets `notif` when it is done."""
        local, remote = self._descriptors(reads)
        mem_type = reads[0].local.mem_type
        local_descs = self._agent.get_xfer_descs(local, mem_type)
        remote_descs = self._agent.get_xfer_descs(remote, reads[0].remote.mem_type)
        handle = self._call(
            self._agent.initialize_xfer, "READ", local_descs, remote_descs, remote_agent, notif
        )
        transfer = Transfer(handle, int(local[:, 1].sum()), len(local), time.perf_counter())
        try:
            state = self._call(self._agent.transfer, handle)
        except NixlError:
            self.release(transfer)
            raise
        if state == "ERR":
            self.release(transfer)
            raise NixlError(f"NIXL could not post a read from {remote_agent}")
        return transfer

    def poll(self, transfer: Transfer) -> str:
        """"DONE", "PROC" or "ERR", without blocking."""
        try:
            return self._agent.check_xfer_state(transfer.handle)
        except self._errors as e:
            logger.warning("NIXL transfer state: %s", e)
            return "ERR"

    def release(self, transfer: Transfer) -> bool:
        """Releases a transfer, cancelling it if it still runs; False if NIXL refused."""
        try:
            self._agent.release_xfer_handle(transfer.handle)
        except self._errors as e:
            logger.warning("NIXL could not release a transfer: %s", e)
            return False
        return True

    def notifications(self) -> list[tuple[str, bytes]]:
        """(sending agent, message) of the notifications received since the last call."""
        notifs = self._call(self._agent.get_new_notifs)
        return [(agent, msg) for agent, msgs in notifs.items() for msg in msgs]

    def close(self) -> None:
        for descs in self._registered.values():
            try:
                self._agent.deregister_memory(descs)
            except self._errors as e:
                logger.debug("NIXL deregister: %s", e)
        self._registered.clear()

    @staticmethod
    def _descriptors(reads: list[GroupRead]) -> tuple[np.ndarray, np.ndarray]:
        local = [
            run_descriptors(r.runs[:, 0], r.runs[:, 2], r.local.base_addr, r.block_bytes,
                            r.local.device_id)
            for r in reads
        ]
        remote = [
            run_descriptors(r.runs[:, 1], r.runs[:, 2], r.remote.base_addr, r.block_bytes,
                            r.remote.device_id)
            for r in reads
        ]
        return np.concatenate(local), np.concatenate(remote)

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._errors as e:
            raise NixlError(f"{type(e).__name__}: {e}") from e
