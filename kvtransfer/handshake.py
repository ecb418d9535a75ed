"""A consumer's view of its producers: handshakes cached per engine id, checked once.

A handshake is fetched from a producer's side channel the first time a pull names its
engine id, checked against this engine (protocol, model, layout of every block group,
compatibility hash) and kept. A producer that restarts comes back under a new NIXL agent
name (and usually a new engine id); params carry the agent name, so a consumer notices
its cached entry is stale, fetches a new one and replaces every entry at that address,
instead of reading through a dead connection.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvferry.kvtransfer.layout import KVLayout, find_layout_mismatch
from kvferry.kvtransfer.nixl_backend import NixlBackend
from kvferry.kvtransfer.params import TRANSFER_PROTOCOL_VERSION, KVTransferParams
from kvferry.kvtransfer.side_channel import HandshakeInfo, rank_agent_name

logger = logging.getLogger(__name__)


class IncompatibleProducerError(Exception):
    """A producer's KV cannot be used here; names the first differing field."""

    def __init__(self, address: str, field: str, ours: object, theirs: object) -> None:
        super().__init__(
            f"producer at {address} is incompatible: {field} is {theirs!r} there and "
            f"{ours!r} here"
        )
        self.field = field


@dataclass(frozen=True)
class LocalIdentity:
    """What this engine compares a producer's handshake with."""

    model_id: str
    # Per group, and within a group per rank (as HandshakeInfo.layouts).
    layouts: list[KVLayout]
    compat_hash: str
    # (pipeline_parallel_size, tensor_parallel_size)
    parallel_sizes: tuple[int, int] = (1, 1)

    @property
    def num_ranks(self) -> int:
        return self.parallel_sizes[0] * self.parallel_sizes[1]


@dataclass(frozen=True)
class RemoteEngine:
    """A producer this engine can read from."""

    address: str
    info: HandshakeInfo


def check_compatible(local: LocalIdentity, address: str, info: HandshakeInfo) -> None:
    """Raises IncompatibleProducerError at the first field that differs."""
    checks: list[tuple[str, object, object]] = [
        ("protocol_version", TRANSFER_PROTOCOL_VERSION, info.protocol_version),
        ("model_id", local.model_id, info.model_id),
        # Reading between engines of other parallel sizes is not built.
        ("pipeline_parallel_size", local.parallel_sizes[0], info.pipeline_parallel_size),
        ("tensor_parallel_size", local.parallel_sizes[1], info.tensor_parallel_size),
        ("num_block_groups", len(local.layouts), len(info.layouts)),
    ]
    for field, ours, theirs in checks:
        if ours != theirs:
            raise IncompatibleProducerError(address, field, ours, theirs)
    _check_records(address, info)
    for index, (ours, theirs) in enumerate(zip(local.layouts, info.layouts, strict=True)):
        mismatch = find_layout_mismatch(ours, theirs)
        if mismatch is not None:
            name, mine, other = mismatch
            group, rank = divmod(index, local.num_ranks)
            where = ([f"group {group}"] if group else []) + (
                [f"rank {rank}"] if local.num_ranks > 1 else [])
            raise IncompatibleProducerError(address, " ".join([*where, name]), mine, other)
    # Equal fields but another hash: the producer hashes something this engine does not.
    if local.compat_hash != info.compat_hash:
        raise IncompatibleProducerError(address, "compat_hash", local.compat_hash, info.compat_hash)


def _check_records(address: str, info: HandshakeInfo) -> None:
    """Raises IncompatibleProducerError for a handshake whose regions or rank agents are not
    what its layouts and sizes say (a broken or hostile producer)."""
    if len(info.regions) != len(info.layouts):
        raise IncompatibleProducerError(address, "the number of regions", len(info.layouts),
                                        len(info.regions))
    for region in info.regions:
        if (region.mem_type not in ("DRAM", "VRAM") or not 0 <= region.base_addr < 2**64
                or not 0 <= region.device_id < 2**31 or region.num_blocks < 1):
            raise IncompatibleProducerError(address, "a region", "a valid region", region)
    if info.num_ranks > 1:
        expected = [rank_agent_name(info.agent_name, r) for r in range(info.num_ranks)]
        if info.rank_agents != expected or len(info.rank_agent_metadata) != info.num_ranks:
            raise IncompatibleProducerError(address, "rank_agents", expected, info.rank_agents)


class RemoteEngines:
    """Handshakes by engine id; NIXL knows exactly the producers cached here."""

    def __init__(self, backend: NixlBackend, local: LocalIdentity) -> None:
        self._backend = backend
        self.local = local
        self._by_engine: dict[str, RemoteEngine] = {}

    def lookup(self, params: KVTransferParams) -> RemoteEngine | None:
        """The cached producer the params name; None when absent or stale."""
        engine = self._by_engine.get(params.remote_engine_id or "")
        if engine is None:
            return None
        if params.kvferry_agent_name and params.kvferry_agent_name != engine.info.agent_name:
            # Same engine id, new process: the cached metadata points at a dead agent.
            return None
        return engine

    def accept(self, address: str, info: HandshakeInfo) -> RemoteEngine:
        """Checks and caches a fresh handshake, replacing stale entries for the producer."""
        check_compatible(self.local, address, info)
        for engine_id, cached in list(self._by_engine.items()):
            if cached.address == address or engine_id == info.engine_id:
                if cached.info.agent_name == info.agent_name:
                    return cached
                self.forget(engine_id)
        self._backend.connect(info)
        engine = RemoteEngine(address, info)
        self._by_engine[info.engine_id] = engine
        logger.info("handshake with engine %s at %s (agent %s)", info.engine_id, address,
                    info.agent_name)
        return engine

    def forget(self, engine_id: str) -> None:
        """Drops a producer (restarted, or a read from it failed): the next pull re-handshakes."""
        engine = self._by_engine.pop(engine_id, None)
        if engine is not None:
            self._backend.remove_remote(engine.info.agent_name)

    def __len__(self) -> int:
        return len(self._by_engine)
