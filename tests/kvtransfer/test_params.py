"""kv_transfer_params: vLLM's shape in, validated; kvferry's fields namespaced."""

from __future__ import annotations

import re

import pytest
from kvferry.kvtransfer.params import TRANSFER_PROTOCOL_VERSION, KVTransferParams

DECODE_PARAMS = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "remote_block_ids": [3, 4, 9],
    "remote_request_id": "cmpl-1",
}


def test_a_prefill_request_asks_for_remote_decode() -> None:
    params = KVTransferParams.from_dict({"do_remote_decode": True})
    assert params == KVTransferParams(do_remote_decode=True)


def test_no_params_and_empty_params_are_none() -> None:
    assert KVTransferParams.from_dict(None) is None
    assert KVTransferParams.from_dict({}) is None


def test_vllm_decode_params_parse_into_one_block_group() -> None:
    params = KVTransferParams.from_dict(DECODE_PARAMS)
    assert params is not None
    assert params.remote_block_ids == ((3, 4, 9),)
    assert (params.remote_engine_id, params.remote_host, params.remote_port) == (
        "prefill-0", "10.0.0.7", 5600)
    assert params.remote_request_id == "cmpl-1"
    assert params.kvferry_protocol_version == TRANSFER_PROTOCOL_VERSION


def test_nested_block_ids_are_one_group_each_and_round_trip() -> None:
    data = {**DECODE_PARAMS, "remote_block_ids": [[3, 4], [7]], "kvferry_num_tokens": 30,
            "kvferry_agent_name": "kvferry-a", "kvferry_lease_s": 30}
    params = KVTransferParams.from_dict(data)
    assert params is not None
    assert params.remote_block_ids == ((3, 4), (7,))
    assert KVTransferParams.from_dict(params.to_dict()) == params
    assert params.to_dict()["remote_block_ids"] == [[3, 4], [7]]


def test_one_group_is_written_as_vllms_flat_list() -> None:
    params = KVTransferParams.from_dict(DECODE_PARAMS)
    assert params is not None
    out = params.to_dict()
    assert out["remote_block_ids"] == [3, 4, 9]
    assert {k: out[k] for k in DECODE_PARAMS} == DECODE_PARAMS


def test_unknown_vllm_fields_are_ignored() -> None:
    params = KVTransferParams.from_dict({**DECODE_PARAMS, "tp_size": 1})
    assert params is not None and params.remote_port == 5600


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
        ({"do_remote_decode": 1}, "do_remote_decode"),
        ({"remote_port": 0}, "remote_port"),
        ({"remote_port": 70000}, "remote_port"),
        ({"remote_port": "5600"}, "remote_port"),
        ({"remote_port": True}, "remote_port"),
        ({"remote_host": ""}, "remote_host"),
        ({"remote_engine_id": 7}, "remote_engine_id"),
        ({"remote_block_ids": [3, 0]}, "remote_block_ids"),
        ({"remote_block_ids": [3, -1]}, "remote_block_ids"),
        ({"remote_block_ids": [3, 2.0]}, "remote_block_ids"),
        ({"remote_block_ids": "3,4"}, "remote_block_ids"),
        ({"remote_block_ids": [[3], [0]]}, "remote_block_ids[1]"),
        ({"remote_block_ids": [[3], []]}, "remote_block_ids[1]"),
        ({"remote_block_ids": []}, "remote_block_ids"),
        ({"remote_request_id": None}, "remote_request_id"),
        ({"kvferry_num_tokens": 0}, "kvferry_num_tokens"),
        ({"kvferry_lease_s": -1}, "kvferry_lease_s"),
        ({"kvferry_protocol_version": 99}, "kvferry_protocol_version"),
        ({"kvferry_leese_s": 3}, "kvferry_leese_s"),
    ],
)
def test_bad_params_raise_naming_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"kv_transfer_params.{field} ")):
        KVTransferParams.from_dict({**DECODE_PARAMS, **change})


def test_params_that_are_not_an_object_raise() -> None:
    with pytest.raises(ValueError, match="kv_transfer_params must be an object"):
        KVTransferParams.from_dict([1, 2])  # type: ignore[arg-type]
