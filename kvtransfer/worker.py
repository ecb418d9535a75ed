"""The worker's side of the connector: registers the KV cache, runs pulls, reports them.

A pull goes through two phases, neither of which blocks the engine loop:

1. prepare (a background thread, side-channel calls only): fetch the producer's handshake
   unless it is cached, then renew the producer's hold, which both proves the producer is
   alive and guarantees the blocks stay put for a whole lease while the read runs;
2. read (the engine thread, NIXL calls only): check the handshake, add the producer's
   agent, start one READ of all block runs with a notification naming the producer's
   request, then poll it on every `get_finished` until done, failed or past
   `pull_timeout_s` (then it is cancelled).

As a producer, `get_finished` also ends the holds whose read notifications arrived and the
holds whose lease ran out; their request ids go back to the scheduler to free the blocks.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvferry.kvtransfer.config import KVTransferConfig
from kvferry.kvtransfer.connector import (
    KVConnectorMetadata,
    KVConnectorOutput,
    ProducerEndpoint,
    PullSpec,
    TransferFailure,
)
from kvferry.kvtransfer.handshake import (
    IncompatibleProducerError,
    LocalIdentity,
    RemoteEngine,
    RemoteEngines,
)
from kvferry.kvtransfer.layout import KVLayout, RegionInfo, block_runs, compatibility_hash
from kvferry.kvtransfer.lease import LeaseTable
from kvferry.kvtransfer.metrics import FailureReason, HoldEnd, KVTransferMetrics
from kvferry.kvtransfer.nixl_backend import GroupRead, NixlBackend, NixlError, Transfer
from kvferry.kvtransfer.params import TRANSFER_PROTOCOL_VERSION
from kvferry.kvtransfer.side_channel import (
    HandshakeInfo,
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
)

logger = logging.getLogger(__name__)

# A finished read's notification to the producer: this prefix, then its request id.
PULLED_NOTIF_PREFIX = b"kvferry/pulled/"


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


@dataclass
class _Pull:
    spec: PullSpec
    prepared: Future[_Prepared] | None = None
    transfer: Transfer | None = None
    engine: RemoteEngine | None = None
    # Monotonic time after which a running read is cancelled.
    deadline: float = 0.0


class KVConnectorWorker:
    """Moves KV blocks for one engine, as producer and as consumer."""

    def __init__(self, config: KVTransferConfig, metrics: KVTransferMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.engine_id = config.engine_id or uuid.uuid4().hex[:12]
        # Unique per process: a restarted producer is a new agent even under the same id.
        self.agent_name = f"kvferry-{self.engine_id}-{uuid.uuid4().hex[:8]}"
        self.leases = LeaseTable(config.lease_s, metrics)
        self._backend: NixlBackend | None = None
        self._engines: RemoteEngines | None = None
        self._layouts: list[KVLayout] = []
        self._regions: list[RegionInfo] = []
        self._server: SideChannelServer | None = None
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvferry-prepare")
        self._pulls: dict[str, _Pull] = {}
        self._output = KVConnectorOutput()

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: object | Sequence[object]) -> ProducerEndpoint:
        """Registers the cache tensor of every block group and starts the side channel.

        `kv_caches`: one tensor (one group) or a sequence indexed by group, each
        (num_blocks, num_layers, 2, block_size, num_kv_heads, head_size), contiguous.
        """
        if self._backend is not None:
            raise RuntimeError("register_kv_caches was already called")
        caches = list(kv_caches) if isinstance(kv_caches, (list, tuple)) else [kv_caches]
        self._layouts = [KVLayout.of_cache(c) for c in caches]
        self._backend = NixlBackend(
            self.agent_name, self.config.ucx_error_handling_mode, self.config.nixl_progress_thread
        )
        self._regions = [self._backend.register(c) for c in caches]
        local = LocalIdentity(
            self.config.model_id, self._layouts,
            compatibility_hash(self.config.model_id, self._layouts),
        )
        self._engines = RemoteEngines(self._backend, local)
        self._server = SideChannelServer(
            self.config.side_channel_host, self.config.side_channel_port,
            self._handshake_info(local), self.leases,
        )
        self._server.start()
        return self.endpoint

    def _handshake_info(self, local: LocalIdentity) -> HandshakeInfo:
        assert self._backend is not None
        return HandshakeInfo(
            protocol_version=TRANSFER_PROTOCOL_VERSION, engine_id=self.engine_id,
            agent_name=self.agent_name, agent_metadata=self._backend.metadata,
            model_id=local.model_id, layouts=self._layouts, regions=self._regions,
            compat_hash=local.compat_hash, lease_s=self.config.lease_s,
        )

    @property
    def endpoint(self) -> ProducerEndpoint:
        if self._server is None:
            raise RuntimeError("register_kv_caches must be called first")
        host = self.config.advertise_host or self.config.side_channel_host
        return ProducerEndpoint(self.engine_id, host, self._server.port, self.agent_name)

    # ------------------------------------------------------------------ each step
    def apply(self, meta: KVConnectorMetadata) -> None:
        """Starts the step's new pulls, then cancels the pulls of finished requests."""
        self.start_load_kv(meta.pulls)
        self.cancel_pulls(meta.cancelled)

    def start_load_kv(self, pulls: Sequence[PullSpec]) -> None:
        """Starts preparing pulls; their reads start from `get_finished`."""
        for spec in pulls:
            if spec.req_id in self._pulls:
                raise RuntimeError(f"request {spec.req_id!r} is already pulling")
            pull = _Pull(spec)
            self._pulls[spec.req_id] = pull
            self._submit_prepare(pull, need_handshake=self._lookup(spec) is None)

    def cancel_pulls(self, req_ids: Sequence[str]) -> None:
        """Drops pulls whose read has not started; running reads finish or time out first."""
        for req_id in req_ids:
            pull = self._pulls.get(req_id)
            if pull is not None and pull.transfer is None:
                del self._pulls[req_id]
                self._output.cancelled_pulls.append(req_id)

    def get_finished(self) -> KVConnectorOutput:
        """Advances every pull and hold without blocking; reports what ended."""
        for req_id, pull in list(self._pulls.items()):
            if pull.transfer is None:
                self._advance_prepare(req_id, pull)
            else:
                self._poll_read(req_id, pull)
        self._end_holds()
        output, self._output = self._output, KVConnectorOutput()
        return output

    # ------------------------------------------------------------------ prepare
    def _lookup(self, spec: PullSpec) -> RemoteEngine | None:
        assert self._engines is not None, "register_kv_caches must be called first"
        return self._engines.lookup(spec.params)

    def _submit_prepare(self, pull: _Pull, need_handshake: bool) -> None:
        params = pull.spec.params
        client = SideChannelClient(
            params.remote_host or "", params.remote_port or 0, self.config.side_channel_timeout_s
        )
        cached = None if need_handshake else self._lookup(pull.spec)
        agent_name = cached.info.agent_name if cached is not None else ""
        pull.prepared = self._executor.submit(
            _prepare, client, agent_name, params.remote_request_id or ""
        )

    def _advance_prepare(self, req_id: str, pull: _Pull) -> None:
        assert pull.prepared is not None
        if not pull.prepared.done():
            return
        try:
            prepared = pull.prepared.result()
        except SideChannelError as e:
            self._fail(req_id, FailureReason.PRODUCER_UNREACHABLE, str(e))
            return
        try:
            engine = self._engine_for(pull.spec, prepared)
        except IncompatibleProducerError as e:
            logger.error("refusing KV from %s: %s", prepared.address, e)
            self._fail(req_id, FailureReason.INCOMPATIBLE, str(e))
            return
        if engine is None:
            # The cached handshake went stale meanwhile (a read from it failed): fetch anew.
            self._submit_prepare(pull, need_handshake=True)
            return
        if engine.info.agent_name != prepared.agent_name:
            # The cached producer restarted: its blocks and its NIXL agent are gone.
            self._forget(engine)
            self._fail(req_id, FailureReason.PRODUCER_RESTARTED,
                       f"engine {engine.info.engine_id} at {engine.address} restarted: the "
                       "blocks it computed are gone")
            return
        self._start_read(req_id, pull, engine, prepared.held)

    def _engine_for(self, spec: PullSpec, prepared: _Prepared) -> RemoteEngine | None:
        assert self._engines is not None
        if prepared.info is None:
            return self._engines.lookup(spec.params)
        return self._engines.accept(prepared.address, prepared.info)

    # ------------------------------------------------------------------ read
    def _start_read(self, req_id: str, pull: _Pull, engine: RemoteEngine, held: bool) -> None:
        params, info = pull.spec.params, engine.info
        if info.engine_id != params.remote_engine_id or (
            params.kvferry_agent_name and params.kvferry_agent_name != info.agent_name
        ):
            self._fail(req_id, FailureReason.PRODUCER_RESTARTED,
                       f"engine {params.remote_engine_id} at {engine.address} restarted (now "
                       f"{info.engine_id}, agent {info.agent_name}): its blocks are gone")
            return
        if not held:
            self._fail(req_id, FailureReason.LEASE_LOST,
                       f"engine {info.engine_id} no longer holds request "
                       f"{params.remote_request_id}")
            return
        try:
            reads = self._group_reads(pull.spec, info)
        except ValueError as e:
            self._fail(req_id, FailureReason.INVALID_PARAMS, str(e))
            return
        assert self._backend is not None
        notif = PULLED_NOTIF_PREFIX + (params.remote_request_id or "").encode()
        try:
            pull.transfer = self._backend.read(info.agent_name, reads, notif)
        except NixlError as e:
            self._forget(engine)
            self._fail(req_id, FailureReason.TRANSFER_ERROR, f"read from {engine.address}: {e}")
            return
        pull.engine = engine
        pull.deadline = time.monotonic() + self.config.pull_timeout_s
        self.metrics.count_descriptors(pull.transfer.num_descriptors)

    def _group_reads(self, spec: PullSpec, info: HandshakeInfo) -> list[GroupRead]:
        reads = []
        for group, (local, remote) in enumerate(zip(spec.local_block_ids, spec.remote_block_ids)):
            local_ids = np.asarray(local, dtype=np.int64)
            remote_ids = np.asarray(remote, dtype=np.int64)
            _check_range(local_ids, self._regions[group].num_blocks, f"group {group} local")
            _check_range(remote_ids, info.regions[group].num_blocks, f"group {group} remote")
            reads.append(GroupRead(
                local=self._regions[group], remote=info.regions[group],
                block_bytes=self._layouts[group].block_bytes,
                runs=block_runs(local_ids, remote_ids),
            ))
        return reads

    def _poll_read(self, req_id: str, pull: _Pull) -> None:
        assert self._backend is not None and pull.transfer is not None
        state = self._backend.poll(pull.transfer)
        if state == "DONE":
            self._backend.release(pull.transfer)
            seconds = time.perf_counter() - pull.transfer.started_at
            self.metrics.observe_pull(pull.transfer.num_bytes, seconds)
            del self._pulls[req_id]
            self._output.finished_pulls.append(req_id)
        elif state == "ERR":
            self._backend.release(pull.transfer)
            assert pull.engine is not None
            self._forget(pull.engine)
            self._fail(req_id, FailureReason.TRANSFER_ERROR,
                       f"read from {pull.engine.address} failed")
        elif time.monotonic() > pull.deadline and self._backend.release(pull.transfer):
            # Released means cancelled: NIXL no longer writes into the local blocks.
            self._fail(req_id, FailureReason.TIMEOUT,
                       f"read did not finish within {self.config.pull_timeout_s} s")

    def _fail(self, req_id: str, reason: FailureReason, message: str) -> None:
        self._pulls.pop(req_id, None)
        self.metrics.count_failure(reason)
        self._output.failed_pulls[req_id] = TransferFailure(reason, message)
        logger.warning("KV pull for %s failed (%s): %s", req_id, reason.value, message)

    def _forget(self, engine: RemoteEngine) -> None:
        assert self._engines is not None
        self._engines.forget(engine.info.engine_id)

    # ------------------------------------------------------------------ producer
    def _end_holds(self) -> None:
        if self._backend is None:
            return
        for msg in self._backend.notifications():
            if msg.startswith(PULLED_NOTIF_PREFIX):
                req_id = msg[len(PULLED_NOTIF_PREFIX):].decode(errors="replace")
                self.leases.end(req_id, HoldEnd.PULLED)
            else:
                logger.debug("ignoring NIXL notification %r", msg[:64])
        self.leases.expire()
        self._output.finished_sends.extend(self.leases.drain_ended())

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """Cancels running reads, stops the side channel, deregisters the cache."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._backend is not None:
            for pull in self._pulls.values():
                if pull.transfer is not None:
                    self._backend.release(pull.transfer)
        self._pulls.clear()
        if self._server is not None:
            self._server.close()
        if self._backend is not None:
            self._backend.close()


def _prepare(client: SideChannelClient, agent_name: str, remote_req_id: str) -> _Prepared:
    """Runs on the preparation thread: handshake unless cached, then renew the hold."""
    info = client.handshake() if not agent_name else None
    reply = client.renew(info.agent_name if info else agent_name, [remote_req_id])
    return _Prepared(client.address, info, held=reply.held[0], agent_name=reply.agent_name)


def _check_range(block_ids: np.ndarray, num_blocks: int, where: str) -> None:
    if block_ids.size and (block_ids.min() < 1 or block_ids.max() >= num_blocks):
        raise ValueError(
            f"{where} block ids must be in [1, {num_blocks}), got "
            f"[{block_ids.min()}, {block_ids.max()}]"
        )
