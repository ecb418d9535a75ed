"""The engine's KV connector: both sides of the transfer layer, built from its config.

The scheduler side decides (which tokens to pull, which blocks to keep); the worker side
moves bytes on its own thread. The engine core hands the worker the scheduler's metadata
after each schedule and collects the worker's report before the next one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvferry.kvtransfer import (
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferConfig,
    KVTransferMetrics,
)


@dataclass
class KVConnector:
    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker
    metrics: KVTransferMetrics

    @classmethod
    def start(
        cls, config: KVTransferConfig, kv_cache: torch.Tensor, block_size: int
    ) -> KVConnector:
        """Registers the cache with NIXL and opens the side channel (its port is bound now)."""
        metrics = KVTransferMetrics()
        worker = KVConnectorWorker(config, metrics)
        endpoint = worker.register_kv_caches(kv_cache)
        scheduler = KVConnectorScheduler(config, block_size, endpoint, worker.leases, metrics)
        return cls(scheduler, worker, metrics)

    def start_transfers(self) -> None:
        """Hands the worker the pulls and cancels the scheduler planned since the last call."""
        self.worker.apply(self.scheduler.build_connector_meta())

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()
