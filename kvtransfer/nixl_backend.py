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

Listeners. UCX's TCP transport listens on every network interface unless `UCX_NET_DEVICES`
names some (interfaces.py), one listener per UCX worker. The agent is given the devices of
its KV host (`net_devices`), and UCX reads them from the environment when the backend is
created: the variable is set for that call only, so nothing else in the process (another
agent, a child process) inherits it. A `UCX_NET_DEVICES` set by hand wins. NIXL's own
listener thread (metadata exchange over a socket) stays off: peers get the metadata from
the side channel.

Split reads. One READ moves its bytes with one kernel copy (CMA, on one host), which runs at
about half of what two cores copy: a large pull is therefore cut into `read_threads` READs
of equal bytes, posted at once from as many threads on as many UCX workers (the agent runs
with NIXL's reader/writer lock so that data-path calls may overlap). The producer's
notification then goes once every part is done, as a message of its own. A 512 MB pull went
from 0.53 to about 0.9 of a plain copy's bandwidth on a 2-core host (benchmarks/kvtransfer.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np
from kvferry.kvtransfer.layout import RegionInfo, run_descriptors

if TYPE_CHECKING:
    from kvferry.kvtransfer.side_channel import HandshakeInfo

logger = logging.getLogger(__name__)


# Pulls smaller than this go as one READ: splitting them saves less than it costs.
SPLIT_MIN_BYTES = 16 * 1024 * 1024
# The network devices UCX may use (interface names, RDMA "device:port"), comma-separated.
UCX_NET_DEVICES_ENV = "UCX_NET_DEVICES"


def _nixl() -> tuple[Any, Any, Any, tuple[type[Exception], ...]]:
    """NIXL's agent classes, its thread-sync modes and its exception types, imported only
    when a connector starts."""
    try:
        from nixl_cu12 import _bindings
        from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError as e:
        raise ImportError(
            "KV transfer needs NIXL: pip install 'kvferry[kvtransfer]' (nixl-cu12)"
        ) from e
    names = [n for n in dir(_bindings) if n.startswith("nixl") and n.endswith("Error")]
    errors = tuple(getattr(_bindings, n) for n in names)
    return nixl_agent, nixl_agent_config, nixl_thread_sync_t, errors


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
    # The rank of a parallel engine whose cache it reads and writes (ranked.py).
    rank: int = 0


@dataclass
class Transfer:
    """A started read: one NIXL transfer, or the parts of a split one."""

    handles: list[Any]
    num_bytes: int
    num_descriptors: int
    started_at: float
    # A split read's notification, sent once every part is done (b"": none, or already
    # carried by the single READ).
    remote_agent: str = ""
    notif: bytes = b""
    notified: bool = False
    # Handles already released (a release NIXL refused for others is retried for those only).
    released: set[int] = field(default_factory=set)


class NixlBackend:
    """One engine's NIXL agent."""

    def __init__(
        self,
        agent_name: str,
        ucx_error_handling_mode: str = "none",
        progress_thread: bool = False,
        read_threads: int = 1,
        split_min_bytes: int = SPLIT_MIN_BYTES,
        net_devices: str | None = None,
    ) -> None:
        """`net_devices`: the only network devices UCX may listen and connect on (the KV
        host's interface, see interfaces.py); None leaves UCX its default, every device."""
        if read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {read_threads}")
        nixl_agent, nixl_agent_config, sync_modes, self._errors = _nixl()
        self.agent_name = agent_name
        self.read_threads = read_threads
        self.split_min_bytes = split_min_bytes
        # Overlapping data-path calls need the agent's reader/writer lock; one thread, none.
        sync = sync_modes.NIXL_THREAD_SYNC_RW if read_threads > 1 else None
        # No backend from the config: its UCX backend cannot take parameters there.
        config = nixl_agent_config(backends=[], enable_prog_thread=progress_thread,
                                   enable_listen_thread=False, sync_mode=sync)
        self._agent = nixl_agent(agent_name, config)
        # One UCX worker per posting thread: reads posted on one worker copy one after another.
        with ucx_net_devices_set(net_devices):
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": ucx_error_handling_mode,
                                               "num_workers": str(read_threads)})
        # Threads that post a split read's other parts while the caller posts the first.
        self._posters = (ThreadPoolExecutor(read_threads - 1, thread_name_prefix="kvferry-read")
                         if read_threads > 1 else None)
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

    def connect(self, info: HandshakeInfo) -> None:
        """Loads a producer's agent, from its handshake."""
        self.add_remote(info.agent_metadata)

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
        """Starts the READ of every group's runs; the producer gets `notif` when it is done.

        A pull of `split_min_bytes` or more is split into `read_threads` READs posted at
        once (see the module docstring); this call returns once every part is posted.
        """
        local, remote = self._descriptors(reads)
        num_bytes = int(local[:, 1].sum())
        started_at = time.perf_counter()
        mem_types = (reads[0].local.mem_type, reads[0].remote.mem_type)
        if self._posters is None or num_bytes < self.split_min_bytes:
            handle = self._post(remote_agent, local, remote, mem_types, notif)
            return Transfer([handle], num_bytes, len(local), started_at)
        parts = split_descriptors(local, remote, self.read_threads)
        others = [self._posters.submit(self._post, remote_agent, lo, re, mem_types, b"")
                  for lo, re in parts[1:]]
        handles, error = [], None
        try:
            handles.append(self._post(remote_agent, *parts[0], mem_types, b""))
        except NixlError as e:
            error = e
        for future in others:
            try:
                handles.append(future.result())
            except NixlError as e:
                error = e
        transfer = Transfer(handles, num_bytes, sum(len(lo) for lo, _ in parts), started_at,
                            remote_agent, notif)
        if error is not None:
            self.release(transfer)
            raise error
        return transfer

    def _post(self, remote_agent: str, local: np.ndarray, remote: np.ndarray,
              mem_types: tuple[str, str], notif: bytes) -> Any:
        """Creates and posts one READ; its handle (released here if posting failed)."""
        local_descs = self._agent.get_xfer_descs(local, mem_types[0])
        remote_descs = self._agent.get_xfer_descs(remote, mem_types[1])
        handle = self._call(
            self._agent.initialize_xfer, "READ", local_descs, remote_descs, remote_agent, notif
        )
        try:
            state = self._call(self._agent.transfer, handle)
        except NixlError:
            self._release_handle(handle)
            raise
        if state == "ERR":
            self._release_handle(handle)
            raise NixlError(f"NIXL could not post a read from {remote_agent}")
        return handle

    def poll(self, transfer: Transfer) -> str:
        """"DONE", "PROC" or "ERR", without blocking; a split read's notification goes when
        its last part is done."""
        try:
            states = [self._agent.check_xfer_state(h) for h in transfer.handles]
        except self._errors as e:
            logger.warning("NIXL transfer state: %s", e)
            return "ERR"
        if "ERR" in states:
            return "ERR"
        if any(s != "DONE" for s in states):
            return "PROC"
        if transfer.notif and not transfer.notified:
            transfer.notified = True
            try:
                self._agent.send_notif(transfer.remote_agent, transfer.notif)
            except self._errors as e:
                # The bytes are here; the producer frees its blocks at its lease's end.
                logger.warning("NIXL could not notify %s: %s", transfer.remote_agent, e)
        return "DONE"

    def release(self, transfer: Transfer) -> bool:
        """Releases a transfer, cancelling it if it still runs; False if NIXL refused (a
        later call retries the handles not yet released)."""
        for index, handle in enumerate(transfer.handles):
            if index not in transfer.released and self._release_handle(handle):
                transfer.released.add(index)
        return len(transfer.released) == len(transfer.handles)

    def _release_handle(self, handle: Any) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
        except self._errors as e:
            logger.warning("NIXL could not release a transfer: %s", e)
            return False
        return True

    def notifications(self) -> list[tuple[str, bytes]]:
        """(sending agent, message) of the notifications received since the last call."""
        notifs = self._call(self._agent.get_new_notifs)
        return [(agent, msg) for agent, msgs in notifs.items() for msg in msgs]

    def close(self) -> None:
        if self._posters is not None:
            self._posters.shutdown(wait=True)
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


@contextlib.contextmanager
def ucx_net_devices_set(net_devices: str | None) -> Iterator[None]:
    """`UCX_NET_DEVICES=net_devices` in this process's environment while UCX reads its
    configuration, unless None or already set by hand (which wins, and is logged)."""
    by_hand = os.environ.get(UCX_NET_DEVICES_ENV)
    if net_devices is None or by_hand is not None:
        if net_devices is not None and by_hand != net_devices:
            logger.warning("%s=%s is set: UCX uses those network devices, not %s (the KV "
                           "host's); its listeners follow them", UCX_NET_DEVICES_ENV, by_hand,
                           net_devices)
        yield
        return
    logger.info("UCX network devices: %s", net_devices)
    os.environ[UCX_NET_DEVICES_ENV] = net_devices
    try:
        yield
    finally:
        del os.environ[UCX_NET_DEVICES_ENV]


def split_descriptors(
    local: np.ndarray, remote: np.ndarray, num_parts: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cuts paired (addr, len, dev) descriptor rows into `num_parts` runs of equal bytes
    (within one byte), cutting a row in two where a boundary falls inside it."""
    lengths = local[:, 1].astype(np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1])
    bounds = [total * k // num_parts for k in range(num_parts + 1)]
    parts = []
    for start, stop in pairwise(bounds):
        if stop <= start:
            continue
        first = int(np.searchsorted(ends, start, side="right"))
        last = int(np.searchsorted(ends, stop, side="left"))
        rows = slice(first, last + 1)
        lo, re = local[rows].copy(), remote[rows].copy()
        row_starts = ends[rows] - lengths[rows]
        # Trim the first row's head and the last row's tail to [start, stop).
        head = start - int(row_starts[0])
        lo[0, 0] += head
        re[0, 0] += head
        lo[:, 1] = np.minimum(ends[rows], stop) - np.maximum(row_starts, start)
        re[:, 1] = lo[:, 1]
        parts.append((lo, re))
    return parts
