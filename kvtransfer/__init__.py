"""Moving KV blocks between engines: the engine's KV connector interface
(`kvferry.engine.core.kv_connector`) implemented over NIXL.

    connector = start_nixl_connector(KVTransferConfig(model_id="llama-3-8b"),
                                     runner.kv_cache, block_size)

See connector.py for the calls a scheduler makes, step by step.
"""

from kvferry.kvtransfer.config import KVTransferConfig
from kvferry.kvtransfer.connector import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    ProducerEndpoint,
    PullSpec,
    start_nixl_connector,
)
from kvferry.kvtransfer.metrics import FailureReason, KVTransferMetrics, KVTransferStats
from kvferry.kvtransfer.params import KVTransferParams
from kvferry.kvtransfer.worker import KVConnectorWorker

__all__ = [
    "FailureReason",
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
    "start_nixl_connector",
]
