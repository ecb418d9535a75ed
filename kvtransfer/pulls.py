"""A consumer's pulls, from params to bytes in its blocks; run by the transfer thread.

A pull goes through two phases:

1. prepare (a pool thread, side-channel calls only): fetch the producer's handshake
   unless it is cached, then renew the producer's hold, which both proves the producer is
   alive and keeps the blocks in place for a whole lease while the read runs. At most
   `max_prepares_per_producer` preparations run at once towards one producer address; the
   others wait their turn without a thread, so a slow or silent producer holds a few of
   the pool's threads (each for at most its connect and read timeouts), never all of them,
   and pulls from other producers go on meanwhile;
2. read (NIXL calls, all on the transfer thread): check the handshake, add the producer's
   agent, start one READ of all block runs with a notification naming the producer's
   request, then poll it until done, failed or past `pull_timeout_s` (then cancel it).

Every pull ends exactly once, in `output`: finished, failed (with a reason) or cancelled.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from kvferry.engine.core.kv_connector import TransferFailure
from kvferry.kvtransfer.auth import SideChannelAuth
from kvferry.kvtransfer.config import KVTransferConfig
from kvferry.kvtransfer.connector import KVConnectorOutput, PullSpec
from kvferry.kvtransfer.handshake import IncompatibleProducerError, RemoteEngine, RemoteEngines
from kvferry.kvtransfer.layout import KVLayout, RegionInfo, block_runs
from kvferry.kvtransfer.metrics import FailureReason, KVTransferMetrics
from kvferry.kvtransfer.nixl_backend import GroupRead, NixlBackend, NixlError, Transfer
from kvferry.kvtransfer.side_channel import (
    HandshakeInfo,
    SideChannelAuthError,
    SideChannelClient,
    SideChannelError,
)

logger = logging.getLogger(__name__)

# A finished read's notification to the producer: this prefix, then its request id.
PULLED_NOTIF_PREFIX = b"kvferry/pulled/"
# Threads preparing pulls (side-channel calls), shared by all producers.
NUM_PREPARE_THREADS = 4


@dataclass(frozen=True)
class _Prepared:
    """What the preparation thread learned from the producer."""

    address: str
    # A fresh handshake, or None when the cached one was used.
    info: HandshakeInfo | None
    # The producer still holds the blocks (and renewed its lease).
    held: bool
    # The producer incarnation that answered.
    agent_name: str
    # The blocks the producer holds for the request, per group (() when not held).
    held_block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass
class _Pull:
    spec: PullSpec
    # The cached handshake to use, while the preparation waits for a slot.
    cached: RemoteEngine | None = None
    prepared: Future[_Prepared] | None = None
    transfer: Transfer | None = None
    engine: RemoteEngine | None = None
    # Monotonic time after which a running read is cancelled.
    deadline: float = 0.0
    # Why the pull fails, once its read is released (a parallel engine's ranks release
    # theirs asynchronously): it ends then, not before, so no write lands afterwards.
    failing: TransferFailure | None = None


class Puller:
    """The pulls in flight; every method runs on the transfer thread."""

    def __init__(
        self,
        config: KVTransferConfig,
        metrics: KVTransferMetrics,
        backend: NixlBackend,
        engines: RemoteEngines,
        local: tuple[list[KVLayout], list[RegionInfo], int],
        wake: Callable[[], None],
        auth: SideChannelAuth | None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self._backend = backend
        self._engines = engines
        # Per group, per rank (group g, rank r at g * num_ranks + r), and the ranks.
        self._layouts, self._regions, self._num_ranks = local
        # Called when a preparation finishes, so the transfer thread does not sleep on it.
        self._wake = wake
        self._auth = auth
        self._executor = ThreadPoolExecutor(max_workers=NUM_PREPARE_THREADS,
                                            thread_name_prefix="kvferry-prepare")
        self._slots = _ProducerSlots(config.max_prepares_per_producer)
        self._pulls: dict[str, _Pull] = {}
        self.output = KVConnectorOutput()

    def __len__(self) -> int:
        return len(self._pulls)

    def add(self, spec: PullSpec) -> None:
        if spec.req_id in self._pulls:
            raise RuntimeError(f"request {spec.req_id!r} is already pulling")
        pull = _Pull(spec)
        self._pulls[spec.req_id] = pull
        held = (spec.params.remote_engine_id, spec.params.remote_request_id)
        if any((p.spec.params.remote_engine_id, p.spec.params.remote_request_id) == held
               for p in self._pulls.values() if p is not pull):
            # Two reads of one hold would each end it on the producer (its notifications
            # count per hold): the second computes its prompt instead.
            self._fail(spec.req_id, FailureReason.INVALID_PARAMS,
                       f"request {held[1]} on engine {held[0]} is already being pulled here")
            return
        self._queue_prepare(pull, cached=self._engines.lookup(spec.params))

    def cancel(self, req_id: str) -> None:
        """Drops a pull whose read has not started; a running read finishes or times out."""
        pull = self._pulls.get(req_id)
        if pull is not None and pull.transfer is None:
            del self._pulls[req_id]
            self.output.cancelled_pulls.append(req_id)

    def advance(self) -> None:
        """Moves every pull on as far as it goes without waiting."""
        for pull in self._slots.take_startable():
            if self._pulls.get(pull.spec.req_id) is pull:  # not cancelled meanwhile
                self._submit_prepare(pull)
        for req_id, pull in list(self._pulls.items()):
            if pull.failing is not None:
                self._finish_failing(req_id, pull)
            elif pull.transfer is None:
                self._advance_prepare(req_id, pull)
            else:
                self._poll_read(req_id, pull)

    def close(self) -> None:
        """Cancels running reads; pending preparations are dropped."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        for pull in self._pulls.values():
            if pull.transfer is not None:
                self._backend.release(pull.transfer)
        self._pulls.clear()

    # ------------------------------------------------------------------ prepare
    def _queue_prepare(self, pull: _Pull, cached: RemoteEngine | None) -> None:
        """Waits for a slot of the producer's (started at once when one is free)."""
        pull.cached, pull.prepared = cached, None
        params = pull.spec.params
        self._slots.queue((params.remote_host or "", params.remote_port or 0), pull)
        self._wake()

    def _submit_prepare(self, pull: _Pull) -> None:
        params = pull.spec.params
        client = SideChannelClient(
            params.remote_host or "", params.remote_port or 0, self.config.side_channel_timeout_s,
            reader=self._backend.agent_name, auth=self._auth,
            connect_timeout_s=self.config.side_channel_connect_timeout_s,
        )
        agent_name = pull.cached.info.agent_name if pull.cached is not None else ""
        pull.prepared = self._executor.submit(
            _prepare, client, agent_name, params.remote_request_id or ""
        )
        self._slots.running((client.host, client.port), pull.prepared)
        pull.prepared.add_done_callback(lambda _: self._wake())

    def _advance_prepare(self, req_id: str, pull: _Pull) -> None:
        if pull.prepared is None or not pull.prepared.done():
            return
        try:
            prepared = pull.prepared.result()
        except SideChannelAuthError as e:
            self._fail(req_id, FailureReason.BAD_SIGNATURE, str(e))
            return
        except SideChannelError as e:
            self._fail(req_id, FailureReason.PRODUCER_UNREACHABLE, str(e))
            return
        try:
            engine = self._engine_for(pull.spec, prepared)
        except IncompatibleProducerError as e:
            logger.error("refusing KV from %s: %s", prepared.address, e)
            self._fail(req_id, FailureReason.INCOMPATIBLE, str(e))
            return
        except NixlError as e:
            self._fail(req_id, FailureReason.INCOMPATIBLE,
                       f"cannot load the agents of the producer at {prepared.address}: {e}")
            return
        if engine is None:
            # The cached handshake went stale meanwhile (a read from it failed): fetch anew.
            self._queue_prepare(pull, cached=None)
            return
        if engine.info.agent_name != prepared.agent_name:
            # The cached producer restarted: its blocks and its NIXL agent are gone.
            self._engines.forget(engine.info.engine_id)
            self._fail(req_id, FailureReason.PRODUCER_RESTARTED,
                       f"engine {engine.info.engine_id} at {engine.address} restarted: the "
                       "blocks it computed are gone")
            return
        self._start_read(req_id, pull, engine, prepared)

    def _engine_for(self, spec: PullSpec, prepared: _Prepared) -> RemoteEngine | None:
        if prepared.info is None:
            return self._engines.lookup(spec.params)
        return self._engines.accept(prepared.address, prepared.info)

    # ------------------------------------------------------------------ read
    def _start_read(self, req_id: str, pull: _Pull, engine: RemoteEngine,
                    prepared: _Prepared) -> None:
        params, info = pull.spec.params, engine.info
        if info.engine_id != params.remote_engine_id or (
            params.kvferry_agent_name and params.kvferry_agent_name != info.agent_name
        ):
            self._fail(req_id, FailureReason.PRODUCER_RESTARTED,
                       f"engine {params.remote_engine_id} at {engine.address} restarted (now "
                       f"{info.engine_id}, agent {info.agent_name}): its blocks are gone")
            return
        if not prepared.held:
            self._fail(req_id, FailureReason.LEASE_LOST,
                       f"engine {info.engine_id} no longer holds request "
                       f"{params.remote_request_id}")
            return
        if prepared.held_block_ids != params.remote_block_ids:
            # Forged or stale params: reading them would put another prompt's KV (or freed
            # blocks) under this request's prompt, and into the prefix cache.
            self._fail(req_id, FailureReason.INVALID_PARAMS,
                       f"the params name blocks that engine {info.engine_id} does not hold "
                       f"for request {params.remote_request_id}")
            return
        try:
            reads = self._group_reads(pull.spec, info)
        except ValueError as e:
            self._fail(req_id, FailureReason.INVALID_PARAMS, str(e))
            return
        notif = PULLED_NOTIF_PREFIX + (params.remote_request_id or "").encode()
        try:
            # On one CPU host the bytes move inside this call (a CMA read); it runs on the
            # transfer thread and releases the GIL, so the engine loop goes on meanwhile.
            pull.transfer = self._backend.read(info.agent_name, reads, notif)
        except NixlError as e:
            self._engines.forget(engine.info.engine_id)
            self._fail(req_id, FailureReason.TRANSFER_ERROR, f"read from {engine.address}: {e}")
            return
        pull.engine = engine
        pull.deadline = time.monotonic() + self.config.pull_timeout_s
        self.metrics.count_descriptors(pull.transfer.num_descriptors)
        self._poll_read(req_id, pull)

    def _group_reads(self, spec: PullSpec, info: HandshakeInfo) -> list[GroupRead]:
        """One read per group and rank: rank r's blocks from the producer's rank r (the
        handshake checked that both engines have the same ranks)."""
        reads = []
        pairs = zip(spec.local_block_ids, spec.remote_block_ids, strict=True)
        for group, (local, remote) in enumerate(pairs):
            if not local:
                continue  # nothing of this group (an encoder pod's hold has no group 0)
            local_ids = np.asarray(local, dtype=np.int64)
            remote_ids = np.asarray(remote, dtype=np.int64)
            runs = block_runs(local_ids, remote_ids)
            for index in self._group_indices(group):
                where = f"group {group}" + (f" rank {index % self._num_ranks}"
                                            if self._num_ranks > 1 else "")
                _check_range(local_ids, self._regions[index].num_blocks, f"{where} local")
                _check_range(remote_ids, info.regions[index].num_blocks, f"{where} remote")
                reads.append(GroupRead(
                    local=self._regions[index], remote=info.regions[index],
                    block_bytes=self._layouts[index].block_bytes, runs=runs,
                    rank=index % self._num_ranks,
                ))
        return reads

    def _group_indices(self, group: int) -> range:
        """Where a group's ranks sit in the layouts and regions."""
        return range(group * self._num_ranks, (group + 1) * self._num_ranks)

    def _poll_read(self, req_id: str, pull: _Pull) -> None:
        assert pull.transfer is not None and pull.engine is not None
        state = self._backend.poll(pull.transfer)
        if state == "DONE":
            self._backend.release(pull.transfer)
            seconds = time.perf_counter() - pull.transfer.started_at
            self.metrics.observe_pull(pull.transfer.num_bytes, seconds)
            cross_blocks = sum(len(group) for group in pull.spec.local_block_ids[1:])
            if cross_blocks:
                block_bytes = sum(self._layouts[i].block_bytes for i in self._group_indices(1))
                self.metrics.observe_cross_pull(cross_blocks * block_bytes, seconds)
            del self._pulls[req_id]
            self.output.finished_pulls.append(req_id)
        elif state == "ERR":
            self._backend.release(pull.transfer)
            self._engines.forget(pull.engine.info.engine_id)
            self._fail(req_id, FailureReason.TRANSFER_ERROR,
                       f"read from {pull.engine.address} failed")
        elif time.monotonic() > pull.deadline and self._backend.release(pull.transfer):
            # Released means cancelled: NIXL no longer writes into the local blocks.
            self._fail(req_id, FailureReason.TIMEOUT,
                       f"read did not finish within {self.config.pull_timeout_s} s")

    def fail_all(self, reason: FailureReason, message: str) -> None:
        """Ends every pull (the transfer thread hit a bug): none is left waiting forever.
        A running read ends once released (at once, or in a later `advance`)."""
        for req_id, pull in list(self._pulls.items()):
            if pull.transfer is None:
                self._fail(req_id, reason, message)
            elif pull.failing is None:
                pull.failing = TransferFailure(reason, message)
                self._finish_failing(req_id, pull)

    def _finish_failing(self, req_id: str, pull: _Pull) -> None:
        assert pull.transfer is not None and pull.failing is not None
        if self._backend.release(pull.transfer):
            self._fail(req_id, FailureReason(pull.failing.reason), pull.failing.message)

    def _fail(self, req_id: str, reason: FailureReason, message: str) -> None:
        self._pulls.pop(req_id, None)
        self.metrics.count_failure(reason)
        self.output.failed_pulls[req_id] = TransferFailure(reason, message)
        logger.warning("KV pull for %s failed (%s): %s", req_id, reason.value, message)


# (host, port) of a producer's side channel.
_Address = tuple[str, int]


@dataclass
class _ProducerSlots:
    """Preparations per producer address: at most `limit` run at once, the rest wait."""

    limit: int
    _running: dict[_Address, list[Future[_Prepared]]] = field(
        default_factory=lambda: defaultdict(list))
    _waiting: dict[_Address, deque[_Pull]] = field(default_factory=lambda: defaultdict(deque))

    def queue(self, address: _Address, pull: _Pull) -> None:
        self._waiting[address].append(pull)

    def running(self, address: _Address, future: Future[_Prepared]) -> None:
        self._running[address].append(future)

    def take_startable(self) -> list[_Pull]:
        """Waiting pulls that may start now (their caller starts them at once).

        A cancelled pull's preparation keeps its slot until its call returns: the producer
        is still busy with it.
        """
        for address in list(self._running):
            self._running[address] = [f for f in self._running[address] if not f.done()]
            if not self._running[address]:
                del self._running[address]
        startable = []
        for address in list(self._waiting):
            waiting = self._waiting[address]
            free = self.limit - len(self._running.get(address, ()))
            while waiting and free > 0:
                startable.append(waiting.popleft())
                free -= 1
            if not waiting:
                del self._waiting[address]
        return startable


def _prepare(client: SideChannelClient, agent_name: str, remote_req_id: str) -> _Prepared:
    """Runs on a pool thread: handshake unless cached, then renew the hold."""
    info = client.handshake() if not agent_name else None
    reply = client.renew(info.agent_name if info else agent_name, [remote_req_id])
    held_block_ids = reply.block_ids[0] if reply.block_ids else []
    return _Prepared(client.address, info, held=reply.held[0], agent_name=reply.agent_name,
                     held_block_ids=tuple(tuple(g) for g in held_block_ids))


def _check_range(block_ids: np.ndarray, num_blocks: int, where: str) -> None:
    if block_ids.size and (block_ids.min() < 1 or block_ids.max() >= num_blocks):
        raise ValueError(
            f"{where} block ids must be in [1, {num_blocks}), got "
            f"[{block_ids.min()}, {block_ids.max()}]"
        )
