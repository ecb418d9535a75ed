"""NIXL agents in a parallel engine's worker processes, driven from its engine core.

An engine of P pipeline stages x T tensor-parallel shards keeps its KV cache in P x T worker
processes (engine/executor/pipeline.py), each holding its rank's layers and kv heads. Each
worker registers its own cache with a NIXL agent of its own (`RankAgentServer`), named
`<engine agent>/r<rank>`; the engine core keeps the control plane of one engine (the side
channel, the leases, the scheduler's side of the connector, the pulls' preparation) and
drives the ranks' agents through `RankedBackend`, which has the calls of `NixlBackend`
that the transfer thread makes:

- a read of a pull is one READ per rank, rank r's blocks from the producer's rank r
  (the handshake lists the producer's rank agents), each posted by its worker; the pull
  is done when every rank's is, and failed once every rank's has ended, one of them in
  error (a rank still reading is cancelled first: no write lands in blocks the
  scheduler has given back);
- a producer's hold ends as pulled when every rank's agent has the reader's notification,
  each from the reader's agent of the same rank.

Core and worker speak over a pipe of their own, apart from the steps': the core sends
commands, a thread in the worker runs them and polls its transfers, and reports back; a
thread in the core reads every worker's reports and wakes the transfer thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from kvferry.kvtransfer.layout import KVLayout, RegionInfo
from kvferry.kvtransfer.nixl_backend import GroupRead, NixlBackend, NixlError, Transfer
from kvferry.kvtransfer.pulls import PULLED_NOTIF_PREFIX
from kvferry.kvtransfer.side_channel import HandshakeInfo, rank_agent_name

logger = logging.getLogger(__name__)

# Seconds a worker's transfer thread waits for a command between polls: while reads run,
# and otherwise.
BUSY_POLL_S = 0.001
IDLE_POLL_S = 0.01
# Notifications a producer keeps while waiting for the other ranks' (oldest dropped first:
# a consumer that never sends them all leaves its hold to the lease).
MAX_PARTIAL_NOTIFS = 65536
# The longest notification a worker passes on (a pull's: a prefix and a request id).
MAX_NOTIF_BYTES = 256


@dataclass(frozen=True)
class RankAgentSpec:
    """How a worker builds its agent (from the pod's KVTransferConfig)."""

    agent_name: str
    ucx_error_handling_mode: str
    progress_thread: bool
    read_threads: int
    read_split_min_bytes: int
    net_devices: str | None
    # Block groups the cache serves (an encoder-decoder's cross-attention blocks share it).
    num_groups: int = 1

    @classmethod
    def for_rank(cls, config: Any, engine_agent: str, rank: int, num_groups: int
                 ) -> RankAgentSpec:
        """Rank `rank`'s agent of the engine whose agent name is `engine_agent`, as
        `config` (a KVTransferConfig) sets NIXL up."""
        return cls(rank_agent_name(engine_agent, rank), config.ucx_error_handling_mode,
                   config.nixl_progress_thread, config.read_threads,
                   config.read_split_min_bytes, config.ucx_net_devices, num_groups)


@dataclass(frozen=True)
class RankAgentInfo:
    """A worker's agent, reported to the core once its cache is registered."""

    agent_name: str
    metadata: bytes
    # Per block group: the rank's cache layout and where it lives.
    layouts: list[KVLayout]
    regions: list[RegionInfo]


# ---------------------------------------------------------------------- worker side
class RankAgentServer:
    """A worker's NIXL agent and the thread that runs the core's commands for it."""

    def __init__(self, conn: Connection, spec: RankAgentSpec, rank: int,
                 caches: Sequence[Any], first_layer: int, first_kv_head: int) -> None:
        self._conn = conn
        self._rank = rank
        self._backend = NixlBackend(spec.agent_name, spec.ucx_error_handling_mode,
                                    spec.progress_thread, spec.read_threads,
                                    spec.read_split_min_bytes, spec.net_devices)
        regions = [self._backend.register(c) for c in caches]
        on_gpu = [c for c in caches if c.device.type == "cuda"]
        self._device = on_gpu[0].device if on_gpu else None
        # The metadata names the registered memory: taken after registering.
        self.info = RankAgentInfo(
            spec.agent_name, self._backend.metadata,
            [KVLayout.of_cache(c, first_layer, first_kv_head) for c in caches], regions)
        # Remote agents loaded into this agent, by name.
        self._remotes: set[str] = set()
        # Reads running, and reads being released (with the state to report once they
        # are: NIXL may refuse a release for a while), by transfer id.
        self._reads: dict[int, Transfer] = {}
        self._releasing: dict[int, tuple[Transfer, str]] = {}
        self._thread = threading.Thread(target=self._run, name=f"kvferry-rank-{rank}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        if self._device is not None:
            import torch

            torch.cuda.set_device(self._device)  # per thread: UCX posts on this one
        try:
            while True:
                busy = self._reads or self._releasing
                if self._conn.poll(BUSY_POLL_S if busy else IDLE_POLL_S):
                    command = self._conn.recv()
                    if command[0] == "close":
                        break
                    self._handle(command)
                self._advance()
        except (EOFError, OSError):
            logger.info("rank %d: the engine core closed the transfer pipe", self._rank)
        except Exception:  # logged; the pipe closes, and the core fails this rank's reads
            logger.exception("rank %d: KV transfer thread failed", self._rank)
        finally:
            for transfer in [*self._reads.values(), *(t for t, _ in self._releasing.values())]:
                self._backend.release(transfer)
            self._backend.close()
            # The core reads the end of the pipe as this rank's reads failing: none waits.
            self._conn.close()

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "read":
            _, tid, remote_name, remote_metadata, reads, notif = command
            try:
                self._read(tid, remote_name, remote_metadata, reads, notif)
            except Exception as e:  # noqa: BLE001 - a producer's bad record fails its read only
                self._report(("state", tid, "ERR", f"{type(e).__name__}: {e}"))
        elif kind == "release":
            transfer = self._reads.pop(command[1], None)
            if transfer is not None:
                self._releasing[command[1]] = (transfer, "RELEASED")
        elif kind == "forget":
            if command[1] in self._remotes:
                self._remotes.discard(command[1])
                self._backend.remove_remote(command[1])
        else:
            raise ValueError(f"unknown transfer command {kind!r}")

    def _read(self, tid: int, remote_name: str, remote_metadata: bytes | None,
              reads: list[GroupRead], notif: bytes) -> None:
        if remote_name not in self._remotes:
            if remote_metadata is None:
                raise NixlError(f"no metadata for {remote_name}")
            loaded = self._backend.add_remote(remote_metadata)
            if isinstance(loaded, bytes):
                loaded = loaded.decode(errors="replace")
            if loaded != remote_name:
                self._backend.remove_remote(loaded)
                raise NixlError(f"the metadata given for {remote_name} is {loaded}'s")
            self._remotes.add(remote_name)
        self._reads[tid] = self._backend.read(remote_name, reads, notif)

    def _advance(self) -> None:
        for tid, transfer in list(self._reads.items()):
            state = self._backend.poll(transfer)
            if state != "PROC":
                # Reported once released: a split read's other parts may still run.
                del self._reads[tid]
                self._releasing[tid] = (transfer, state)
        for tid, (transfer, state) in list(self._releasing.items()):
            if self._backend.release(transfer):
                del self._releasing[tid]
                self._report(("state", tid, state, ""))
        try:
            notifs = self._backend.notifications()
        except NixlError as e:
            logger.warning("rank %d: reading NIXL notifications: %s", self._rank, e)
            return
        notifs = [(agent, msg) for agent, msg in notifs
                  if msg.startswith(PULLED_NOTIF_PREFIX) and len(msg) <= MAX_NOTIF_BYTES]
        if notifs:
            self._report(("notifs", notifs))

    def _report(self, message: tuple) -> None:
        self._conn.send(message)


# ---------------------------------------------------------------------- core side
@dataclass
class _RankedRead:
    """One pull's READs on the ranks: each rank's state ("PROC", "DONE", "ERR", "RELEASED")."""

    states: list[str]
    released_asked: bool = False
    errors: list[str] = field(default_factory=list)


class RankedBackend:
    """The transfer thread's NIXL calls, made by the ranks' agents in the workers."""

    def __init__(self, agent_name: str, conns: Sequence[Connection],
                 ranks: Sequence[RankAgentInfo]) -> None:
        if len(conns) != len(ranks):
            raise ValueError(f"{len(conns)} transfer pipes for {len(ranks)} ranks")
        for rank, info in enumerate(ranks):
            if info.agent_name != rank_agent_name(agent_name, rank):
                raise ValueError(f"rank {rank}'s agent is {info.agent_name!r}, not "
                                 f"{rank_agent_name(agent_name, rank)!r}")
        self.agent_name = agent_name
        # The core has no agent of its own: the handshake lists the ranks'.
        self.metadata = b""
        self.ranks = list(ranks)
        self._conns = list(conns)
        # One per pipe: a rank busy in a long read delays its own commands only.
        self._send_locks = [threading.Lock() for _ in conns]
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._reads: dict[int, _RankedRead] = {}
        # Producers' rank agents (name, metadata) by their engine agent name.
        self._remotes: dict[str, list[tuple[str, bytes]]] = {}
        # (reader, message) -> the ranks whose agent has it, oldest first.
        self._partial: OrderedDict[tuple[str, bytes], set[int]] = OrderedDict()
        self._notifs: list[tuple[str, bytes]] = []
        self._gone: set[int] = set()
        self.on_report: Callable[[], None] = lambda: None
        # Whether a hold named by a notification is held for that reader (the connector
        # asks its lease table): only then do the ranks' notifications count.
        self.holds_for: Callable[[str, str], bool] = lambda req_id, reader: True
        self._closed = False
        self._reader = threading.Thread(target=self._read_reports, name="kvferry-ranks",
                                        daemon=True)
        self._reader.start()

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    # ------------------------------------------------------------------ NixlBackend's calls
    def connect(self, info: HandshakeInfo) -> None:
        """Remembers a producer's rank agents (loaded by each worker at its first read)."""
        if len(info.rank_agents) != self.num_ranks or len(info.rank_agent_metadata) != len(
                info.rank_agents):
            raise NixlError(f"the producer lists {len(info.rank_agents)} rank agents, this "
                            f"engine has {self.num_ranks} ranks")
        with self._lock:
            self._remotes[info.agent_name] = list(zip(info.rank_agents,
                                                      info.rank_agent_metadata, strict=True))

    def remove_remote(self, agent_name: str) -> None:
        with self._lock:
            remotes = self._remotes.pop(agent_name, None)
        for rank, (name, _) in enumerate(remotes or ()):
            self._send(rank, ("forget", name))

    def read(self, remote_agent: str, reads: list[GroupRead], notif: bytes) -> Transfer:
        """Posts each rank's READs on its worker; returns at once."""
        with self._lock:
            remotes = self._remotes.get(remote_agent)
            if remotes is None:
                raise NixlError(f"no handshake with {remote_agent}")
            if self._gone:
                raise NixlError(f"the transfer agents of ranks {sorted(self._gone)} are gone")
            tid = next(self._ids)
            self._reads[tid] = _RankedRead(["PROC"] * self.num_ranks)
        by_rank: dict[int, list[GroupRead]] = defaultdict(list)
        for read in reads:
            by_rank[read.rank].append(read)
        for rank in range(self.num_ranks):
            name, metadata = remotes[rank]
            rank_reads = by_rank.get(rank, [])
            if rank_reads:
                self._send(rank, ("read", tid, name, metadata, rank_reads, notif))
            else:
                self._set_state(tid, rank, "DONE", "")
        num_bytes = sum(int(r.runs[:, 2].sum()) * r.block_bytes for r in reads)
        num_descs = sum(len(r.runs) for r in reads)
        return Transfer([tid], num_bytes, num_descs, time.perf_counter())

    def poll(self, transfer: Transfer) -> str:
        """"DONE" once every rank's READ is; "ERR" once every rank's has ended (done,
        failed or cancelled), one in error; else "PROC" (cancelling the others after an
        error, so that none writes into the blocks once the pull is over)."""
        tid = transfer.handles[0]
        with self._lock:
            read = self._reads.get(tid)
            if read is None:
                return "ERR"
            states = list(read.states)
            cancel = "ERR" in states and not read.released_asked
            if cancel:
                read.released_asked = True
        if cancel:
            self._ask_release(tid, states)
        if "PROC" in states:
            return "PROC"
        if "ERR" in states:
            return "ERR"
        # Cancelled at the caller's `release` (a timeout): its next call says so.
        return "PROC" if "RELEASED" in states else "DONE"

    def release(self, transfer: Transfer) -> bool:
        """True once no rank's READ can write any more (its record is then dropped)."""
        tid = transfer.handles[0]
        with self._lock:
            read = self._reads.get(tid)
            if read is None:
                return True
            states = list(read.states)
            ask = not read.released_asked
            read.released_asked = True
            if all(s != "PROC" for s in states):
                del self._reads[tid]
                return True
        if ask:
            self._ask_release(tid, states)
        return False

    def notifications(self) -> list[tuple[str, bytes]]:
        """(reader, message) of the notifications every rank has received."""
        with self._lock:
            notifs, self._notifs = self._notifs, []
        return notifs

    def close(self) -> None:
        """Stops the workers' agents (if they still run) and closes their pipes."""
        self._closed = True
        for rank in range(self.num_ranks):
            self._send(rank, ("close",))
        self._reader.join(timeout=2.0)
        for conn in self._conns:
            conn.close()

    # ------------------------------------------------------------------ reports
    def _ask_release(self, tid: int, states: list[str]) -> None:
        for rank, state in enumerate(states):
            if state == "PROC":
                self._send(rank, ("release", tid))

    def _send(self, rank: int, command: tuple) -> None:
        try:
            with self._send_locks[rank]:
                self._conns[rank].send(command)
        except (OSError, ValueError) as e:
            if not self._closed:
                logger.warning("rank %d's transfer agent is unreachable: %s", rank, e)
            self._rank_gone(rank)

    def _read_reports(self) -> None:
        conns = {conn: rank for rank, conn in enumerate(self._conns)}
        try:
            while conns and not self._closed:
                for conn in wait(list(conns), timeout=0.2):
                    rank = conns[conn]  # type: ignore[index]
                    try:
                        message = conn.recv()  # type: ignore[union-attr]
                    except (EOFError, OSError):
                        del conns[conn]
                        self._rank_gone(rank)
                        continue
                    self._on_report(rank, message)
                self.on_report()
        except (OSError, ValueError):  # a pipe closed under the wait: shutting down
            pass
        except Exception:  # a report it cannot read: no rank's state would change again
            logger.exception("reading the ranks' transfer reports failed")
        finally:
            for rank in range(self.num_ranks):
                self._rank_gone(rank)
            self.on_report()

    def _on_report(self, rank: int, message: tuple) -> None:
        if message[0] == "state":
            _, tid, state, error = message
            self._set_state(tid, rank, state, error)
        elif message[0] == "notifs":
            self._count_notifs(rank, message[1])

    def _set_state(self, tid: int, rank: int, state: str, error: str) -> None:
        with self._lock:
            read = self._reads.get(tid)
            if read is None:
                return
            read.states[rank] = state
            if error:
                read.errors.append(f"rank {rank}: {error}")
                logger.warning("KV read %d on rank %d failed: %s", tid, rank, error)

    def _rank_gone(self, rank: int) -> None:
        """A worker's agent is gone: its READs end in error (its process, and the blocks
        it would write into, with it)."""
        with self._lock:
            if rank not in self._gone and not self._closed:
                logger.error("rank %d's KV transfer agent is gone: this engine pulls nothing "
                             "more (its reads fail, requests compute their prompts) until it "
                             "restarts", rank)
            self._gone.add(rank)
            for read in self._reads.values():
                if read.states[rank] == "PROC":
                    read.states[rank] = "ERR"

    def _count_notifs(self, rank: int, notifs: list[tuple[str, bytes]]) -> None:
        with self._lock:
            for sender, msg in notifs:
                reader, sep, sender_rank = sender.rpartition("/r")
                req_id = msg[len(PULLED_NOTIF_PREFIX):].decode(errors="replace")
                if not sep or sender_rank != str(rank) or not self.holds_for(req_id, reader):
                    logger.debug("rank %d: ignoring a notification from %s", rank, sender)
                    continue
                key = (reader, msg)
                ranks = self._partial.setdefault(key, set())
                ranks.add(rank)
                if len(ranks) == self.num_ranks:
                    del self._partial[key]
                    self._notifs.append(key)
            while len(self._partial) > MAX_PARTIAL_NOTIFS:
                self._partial.popitem(last=False)
