"""The KV connector interface: the NIXL connector implements it, and a request's transfer
parameters cross from the front end to the core already parsed."""

from __future__ import annotations

import msgspec
from kvferry.engine.core.kv_connector import KVConnectorSchedulerBase, KVConnectorWorkerBase
from kvferry.engine.core.messages import AddRequest, CoreInput, EngineCoreRequest
from kvferry.engine.sampling_params import SamplingParams
from kvferry.kvtransfer.connector import KVConnectorScheduler
from kvferry.kvtransfer.params import KVTransferParams
from kvferry.kvtransfer.worker import KVConnectorWorker


def test_the_nixl_connector_implements_every_hook() -> None:
    assert issubclass(KVConnectorScheduler, KVConnectorSchedulerBase)
    assert issubclass(KVConnectorWorker, KVConnectorWorkerBase)
    assert not KVConnectorScheduler.__abstractmethods__
    assert not KVConnectorWorker.__abstractmethods__


def test_parsed_params_cross_to_the_core_process_typed() -> None:
    params = KVTransferParams.from_dict({
        "do_remote_prefill": True, "remote_engine_id": "p-0", "remote_host": "10.0.0.7",
        "remote_port": 7001, "remote_block_ids": [[3, 4], [9]], "remote_request_id": "r-1",
        "kvferry_num_tokens": 8, "kvferry_prompt_hash": "ab" * 16,
    })
    request = EngineCoreRequest("d-1", [5, 6, 7], SamplingParams(max_tokens=4), [2], 1.5,
                                kv_transfer_params=params)

    wire = msgspec.msgpack.encode(AddRequest(request))
    received = msgspec.msgpack.Decoder(CoreInput).decode(wire)

    assert isinstance(received.request.kv_transfer_params, KVTransferParams)
    assert received.request.kv_transfer_params == params
