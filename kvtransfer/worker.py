"""The worker's side of the connector: registers the KV cache, runs pulls, reports them.

All NIXL work happens on one transfer thread that owns the agent: it starts and polls the
pulls (pulls.py), reads the producer's notifications and ends expired leases. The engine
thread only hands it commands (`apply`) and collects what ended (`get_finished`), so no
engine step waits for a transfer, even on a CPU host where a read's bytes move inside
NIXL's post call. The thread wakes every millisecond while pulls run and every 10 ms
otherwise (NIXL progresses on these polls; the agent has no spinning progress thread).

As a producer, the thread ends the holds whose read notifications arrived and the holds
whose lease ran out; their request ids go back to the scheduler to free the blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Sequence

from kvferry.engine.core.kv_connector import KVConnectorWorkerBase
from kvferry.kvtransfer.config import KVTransferConfig
from kvferry.kvtransfer.connector import (
    KVConnectorMetadata,
    KVConnectorOutput,
    ProducerEndpoint,
    PullSpec,
)
from kvferry.kvtransfer.handshake import LocalIdentity, RemoteEngines
from kvferry.kvtransfer.layout import KVLayout, RegionInfo, compatibility_hash
from kvferry.kvtransfer.lease import LeaseTable
from kvferry.kvtransfer.metrics import FailureReason, HoldEnd, KVTransferMetrics
from kvferry.kvtransfer.nixl_backend import NixlBackend
from kvferry.kvtransfer.params import TRANSFER_PROTOCOL_VERSION
from kvferry.kvtransfer.pulls import PULLED_NOTIF_PREFIX, Puller
from kvferry.kvtransfer.ranked import RankedBackend
from kvferry.kvtransfer.side_channel import HandshakeInfo, SideChannelServer

logger = logging.getLogger(__name__)

# Seconds the transfer thread sleeps between polls: while pulls run, and otherwise.
BUSY_POLL_S = 0.001
IDLE_POLL_S = 0.01


class KVConnectorWorker(KVConnectorWorkerBase):
    """Moves KV blocks for one engine, as producer and as consumer."""

    def __init__(self, config: KVTransferConfig, metrics: KVTransferMetrics,
                 agent_name: str | None = None) -> None:
        """`agent_name`: the one `new_agent_name(config)` gave (a parallel engine's ranks'
        agents are named after it), else a new one."""
        config.require_may_transfer()
        self.config = config
        self.metrics = metrics
        self.agent_name = agent_name or new_agent_name(config)
        self.engine_id = engine_id_of(self.agent_name)
        self.leases = LeaseTable(config.lease_s, metrics)
        self._backend: NixlBackend | RankedBackend | None = None
        self._layouts: list[KVLayout] = []
        self._regions: list[RegionInfo] = []
        self._server: SideChannelServer | None = None
        self._puller: Puller | None = None
        # Engine thread -> transfer thread: ("pull", [PullSpec]) and ("cancel", [req_id]).
        self._commands: queue.SimpleQueue[tuple[str, list]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # Guards `_output`, filled by the transfer thread and taken by the engine thread.
        self._lock = threading.Lock()
        self._output = KVConnectorOutput()

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: object | Sequence[object]) -> ProducerEndpoint:
        """Registers the cache tensor of every block group with an agent of this process,
        and starts the side channel.

        `kv_caches`: one tensor (one group) or a sequence indexed by group, each
        (num_blocks, num_layers, 2, block_size, num_kv_heads, head_size), contiguous.
        """
        if self._backend is not None:
            raise RuntimeError("the KV caches are already registered")
        caches = list(kv_caches) if isinstance(kv_caches, (list, tuple)) else [kv_caches]
        backend = NixlBackend(
            self.agent_name, self.config.ucx_error_handling_mode, self.config.nixl_progress_thread,
            self.config.read_threads, self.config.read_split_min_bytes,
            self.config.ucx_net_devices,
        )
        layouts = [KVLayout.of_cache(c) for c in caches]
        return self._start(backend, layouts, [backend.register(c) for c in caches], (1, 1))

    def attach_ranks(self, backend: RankedBackend,
                     parallel_sizes: tuple[int, int]) -> ProducerEndpoint:
        """A parallel engine's ranks (pipeline, tensor sizes `parallel_sizes`), each of whose
        caches its worker's agent registered; starts the side channel."""
        if self._backend is not None:
            raise RuntimeError("the KV caches are already registered")
        ranks = backend.ranks
        if len(ranks) != parallel_sizes[0] * parallel_sizes[1] or backend.agent_name != (
                self.agent_name):
            raise ValueError(f"{len(ranks)} rank agents of {backend.agent_name} for parallel "
                             f"sizes {parallel_sizes} of {self.agent_name}")
        groups = range(len(ranks[0].layouts))
        layouts = [rank.layouts[g] for g in groups for rank in ranks]
        regions = [rank.regions[g] for g in groups for rank in ranks]
        backend.on_report = self._wake.set
        backend.holds_for = self.leases.holds_for
        return self._start(backend, layouts, regions, parallel_sizes)

    def _start(self, backend: NixlBackend | RankedBackend, layouts: list[KVLayout],
               regions: list[RegionInfo], parallel_sizes: tuple[int, int]) -> ProducerEndpoint:
        """`layouts`, `regions`: per group, and within a group per rank (HandshakeInfo's)."""
        self._backend, self._layouts, self._regions = backend, layouts, regions
        num_ranks = parallel_sizes[0] * parallel_sizes[1]
        local = LocalIdentity(
            self.config.model_id, layouts,
            compatibility_hash(self.config.model_id, layouts, num_ranks), parallel_sizes,
        )
        engines = RemoteEngines(backend, local)
        auth = self.config.side_channel_auth()
        self._puller = Puller(self.config, self.metrics, backend, engines,
                              (layouts, regions, num_ranks), self._wake.set, auth)
        self._server = SideChannelServer(
            self.config.side_channel_host, self.config.side_channel_port,
            self._handshake_info(local), self.leases, auth,
        )
        self._server.start()
        self._thread = threading.Thread(target=self._run, name="kvferry-transfer", daemon=True)
        self._thread.start()
        return self.endpoint

    def _handshake_info(self, local: LocalIdentity) -> HandshakeInfo:
        assert self._backend is not None
        ranks = self._backend.ranks if isinstance(self._backend, RankedBackend) else []
        return HandshakeInfo(
            protocol_version=TRANSFER_PROTOCOL_VERSION, engine_id=self.engine_id,
            agent_name=self.agent_name, agent_metadata=self._backend.metadata,
            model_id=local.model_id, layouts=self._layouts, regions=self._regions,
            compat_hash=local.compat_hash, lease_s=self.config.lease_s,
            pipeline_parallel_size=local.parallel_sizes[0],
            tensor_parallel_size=local.parallel_sizes[1],
            rank_agents=[r.agent_name for r in ranks], rank_agent_metadata=[r.metadata for r in ranks],
        )

    @property
    def endpoint(self) -> ProducerEndpoint:
        if self._server is None:
            raise RuntimeError("register_kv_caches must be called first")
        host = self.config.advertise_host or self.config.side_channel_host
        return ProducerEndpoint(self.engine_id, host, self._server.port, self.agent_name)

    # ------------------------------------------------------------------ engine thread
    def apply(self, meta: KVConnectorMetadata) -> None:
        """Starts the step's new pulls, then cancels the pulls of finished requests."""
        self.start_load_kv(meta.pulls)
        self.cancel_pulls(meta.cancelled)

    def start_load_kv(self, pulls: Sequence[PullSpec]) -> None:
        """Starts pulls; they end in a later `get_finished`."""
        if pulls:
            self._commands.put(("pull", list(pulls)))
            self._wake.set()

    def cancel_pulls(self, req_ids: Sequence[str]) -> None:
        """Drops pulls whose read has not started; running reads finish or time out first."""
        if req_ids:
            self._commands.put(("cancel", list(req_ids)))
            self._wake.set()

    def get_finished(self) -> KVConnectorOutput:
        """What ended since the last call: pulls, cancelled pulls, producer holds. Never waits."""
        with self._lock:
            output, self._output = self._output, KVConnectorOutput()
        return output

    # ------------------------------------------------------------------ transfer thread
    def _run(self) -> None:
        assert self._puller is not None
        while not self._stopping.is_set():
            try:
                self._step(self._puller)
            except Exception:  # the thread must outlive a bug, or pulls would wait forever
                logger.exception("KV transfer thread step failed; failing the pulls in flight")
                self._puller.fail_all(FailureReason.TRANSFER_ERROR, "internal error, see log")
                self._publish(self._puller, [])
            self._wake.wait(BUSY_POLL_S if len(self._puller) else IDLE_POLL_S)
            self._wake.clear()

    def _step(self, puller: Puller) -> None:
        while not self._commands.empty():
            command, items = self._commands.get_nowait()
            for item in items:
                if command == "pull":
                    puller.add(item)
                else:
                    puller.cancel(item)
        puller.advance()
        self._publish(puller, self._end_holds())

    def _end_holds(self) -> list[str]:
        assert self._backend is not None
        for agent, msg in self._backend.notifications():
            if msg.startswith(PULLED_NOTIF_PREFIX):
                req_id = msg[len(PULLED_NOTIF_PREFIX):].decode(errors="replace")
                self.leases.end(req_id, HoldEnd.PULLED, reader=agent)
            else:
                logger.debug("ignoring NIXL notification %r", msg[:64])
        self.leases.expire()
        return self.leases.drain_ended()

    def _publish(self, puller: Puller, ended_holds: list[str]) -> None:
        done, puller.output = puller.output, KVConnectorOutput()
        with self._lock:
            out = self._output
            out.finished_pulls.extend(done.finished_pulls)
            out.failed_pulls.update(done.failed_pulls)
            out.cancelled_pulls.extend(done.cancelled_pulls)
            out.finished_sends.extend(ended_holds)

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """Stops the transfer thread, cancels running reads, stops the side channel."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._puller is not None:
            self._puller.close()
        if self._server is not None:
            self._server.close()
        if self._backend is not None:
            self._backend.close()




def new_agent_name(config: KVTransferConfig) -> str:
    """A name for an engine's NIXL agent, unique per process start (a restarted producer is a
    new agent even under the same engine id): `kvferry-<engine id>-<random>`."""
    engine_id = config.engine_id or uuid.uuid4().hex[:12]
    return f"kvferry-{engine_id}-{uuid.uuid4().hex[:8]}"


def engine_id_of(agent_name: str) -> str:
    return agent_name.removeprefix("kvferry-").rsplit("-", 1)[0]
