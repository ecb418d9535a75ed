"""Moving KV blocks between engines: the engine's KV connector interface
(`kvferry.engine.core.kv_connector`) implemented over NIXL.

    connector = start_nixl_connector(KVTransferConfig(model_id="llama-3-8b",
                                                      transfer_key=key),
                                     runner.kv_cache, block_size)

See connector.py for the calls a scheduler makes, step by step, and auth.py for the key.

The names below are imported on first use: the operator and the command line read the
key, the params and the config (auth.py, params.py, config.py) without importing torch,
which the connector needs.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the submodule that defines it.
_EXPORTS = {
    "FailureReason": "metrics",
    "KVConnectorMetadata": "connector",
    "KVConnectorOutput": "connector",
    "KVConnectorScheduler": "connector",
    "KVConnectorWorker": "worker",
    "KVTransferConfig": "config",
    "KVTransferMetrics": "metrics",
    "KVTransferParams": "params",
    "KVTransferStats": "metrics",
    "ProducerEndpoint": "connector",
    "PullSpec": "connector",
    "start_nixl_connector": "connector",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
