"""What a pod admits of incoming kv_transfer_params, before anything reaches its engine."""

from __future__ import annotations

import dataclasses
import time

import pytest
from kvferry.kvtransfer.admission import TransferAdmission
from kvferry.kvtransfer.auth import TransferKey, sign_params
from kvferry.kvtransfer.config import KVTransferConfig
from kvferry.kvtransfer.params import KVTransferParams
from kvferry_testing.keys import TEST_KEY

PULL = KVTransferParams(
    do_remote_prefill=True, remote_engine_id="prefill-0", remote_host="10.0.0.7",
    remote_port=5600, remote_block_ids=((3, 4),), remote_request_id="cmpl-1",
    kvferry_agent_name="agent-p", kvferry_num_tokens=20, kvferry_lease_s=30.0,
)
HOLD = KVTransferParams(do_remote_decode=True)


def admission(**fields: object) -> TransferAdmission:
    return TransferAdmission(KVTransferConfig(**{"transfer_key": TEST_KEY, **fields}))


def failures(adm: TransferAdmission) -> dict[str, int]:
    return adm.metrics.snapshot().failures


def test_signed_params_and_prefill_hops_are_admitted() -> None:
    adm = admission(role="decode")
    signed = sign_params(PULL, TEST_KEY, time.time())
    assert adm.admit(signed) is signed
    assert admission(role="prefill").admit(HOLD) is HOLD
    assert failures(adm) == {} and adm.num_fallbacks == 0


@pytest.mark.parametrize("params", [
    PULL, sign_params(PULL, TransferKey(b"o" * 32), time.time()),
    dataclasses.replace(sign_params(PULL, TEST_KEY, time.time()), remote_port=22),
], ids=["unsigned", "another key", "altered"])
def test_under_recompute_bad_params_are_dropped_and_counted(params: KVTransferParams) -> None:
    adm = admission()
    assert adm.admit(params) is None
    assert failures(adm) == {"bad_signature": 1} and adm.num_fallbacks == 1


def test_under_fail_bad_or_expired_params_are_the_clients_error() -> None:
    adm = admission(failure_policy="fail")
    with pytest.raises(ValueError, match=r"^kv_transfer_params carry no kvferry_mac.*before "
                                         r"contacting 10\.0\.0\.7:5600\)$"):
        adm.admit(PULL)
    with pytest.raises(ValueError, match="expired"):
        adm.admit(sign_params(PULL, TEST_KEY, time.time() - 3600))
    assert failures(adm) == {"bad_signature": 1, "params_expired": 1}
    assert adm.num_fallbacks == 0


def test_a_decode_pod_admits_no_prefill_hop() -> None:
    with pytest.raises(ValueError, match="this is a decode pod"):
        admission(role="decode").admit(HOLD)


def test_without_a_key_nothing_is_admitted_and_the_message_says_how() -> None:
    adm = TransferAdmission(KVTransferConfig(role="decode"))
    for params in (HOLD, sign_params(PULL, TEST_KEY, time.time())):
        with pytest.raises(ValueError) as error:
            adm.admit(params)
        message = str(error.value)
        assert message.startswith("kv_transfer_params: this pod has no KV transfer key")
        assert "--kv-transfer-key-file FILE or $KVFERRY_KV_TRANSFER_KEY" in message
        assert "--kv-transfer-insecure" in message
    with pytest.raises(ValueError, match="runs without KV transfer"):
        TransferAdmission(None).admit(HOLD)


def test_an_insecure_pod_admits_unsigned_params() -> None:
    adm = TransferAdmission(KVTransferConfig(insecure=True, role="decode"))
    assert adm.admit(PULL) is PULL
