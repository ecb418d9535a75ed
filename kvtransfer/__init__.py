"""Moving KV blocks between engines: the connector the engine calls, NIXL underneath.

    config = KVTransferConfig(model_id="llama-3-8b")
    metrics = KVTransferMetrics()
    worker = KVConnectorWorker(config, metrics)
    endpoint = worker.register_kv_caches(runner.kv_cache)
    scheduler = KVConnectorScheduler(config, block_size, endpoint, worker.leases, metrics)

See connector.py for the calls a scheduler makes, step by step.
"""

from kvferry.kvtransfer.config import KVTransferConfig
from kvferry.kvtransfer.connector import (
    FinishedTransfers,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    ProducerEndpoint,
    PullSpec,
    TransferFailure,
)
from kvferry.kvtransfer.metrics import FailureReason, KVTransferMetrics, KVTransferStats
from kvferry.kvtransfer.params import KVTransferParams
from kvferry.kvtransfer.worker import KVConnectorWorker

__all__ = [
    "FailureReason",
    "FinishedTransfers",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "KVTransferConfig",
    "KVTransferMetrics",
    "KVTransferParams",
    "KVTransferStats",
    "ProducerEndpoint",
    "PullSpec",
    "TransferFailure",
]
