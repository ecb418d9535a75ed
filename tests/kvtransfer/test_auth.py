"""The transfer key: what it signs, what a changed field does to the signature, and that
the key never shows."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from kvferry.kvtransfer.auth import (
    KEY_ENV,
    PARAMS_CLOCK_SKEW_S,
    TransferKey,
    check_params,
    key_from_environment,
    sign_params,
)
from kvferry.kvtransfer.config import KVTransferConfig
from kvferry.kvtransfer.metrics import FailureReason
from kvferry.kvtransfer.params import KVTransferParams
from kvferry_testing.keys import TEST_KEY, TEST_KEY_TEXT

NOW = 1_800_000_000.0
PARAMS = KVTransferParams(
    do_remote_prefill=True, remote_engine_id="prefill-0", remote_host="10.0.0.7",
    remote_port=5600, remote_block_ids=((3, 4, 9),), remote_request_id="cmpl-1",
    kvferry_agent_name="kvferry-prefill-0-ab", kvferry_num_tokens=40, kvferry_lease_s=30.0,
    kvferry_prompt_hash="0" * 32,
)


def test_signed_params_verify_until_they_expire() -> None:
    signed = sign_params(PARAMS, TEST_KEY, NOW)
    assert signed.kvferry_expires_at == NOW + 30
    assert len(signed.kvferry_mac or "") == 64
    assert check_params(signed, TEST_KEY, NOW + 30 + PARAMS_CLOCK_SKEW_S) is None
    refusal = check_params(signed, TEST_KEY, NOW + 31 + PARAMS_CLOCK_SKEW_S)
    assert refusal is not None and refusal.reason is FailureReason.PARAMS_EXPIRED


def test_params_verify_after_json_and_a_router_that_rewrites_numbers() -> None:
    """A router may re-encode 30.0 as 30 and one block group as a flat list: still valid."""
    wire = sign_params(PARAMS, TEST_KEY, NOW).to_dict()
    wire["kvferry_lease_s"] = 30
    parsed = KVTransferParams.from_dict(json.loads(json.dumps(wire)))
    assert parsed is not None and check_params(parsed, TEST_KEY, NOW) is None


@pytest.mark.parametrize(("field", "value"), [
    ("remote_engine_id", "prefill-1"), ("remote_host", "10.0.0.8"), ("remote_port", 5601),
    ("remote_block_ids", ((3, 4, 8),)), ("remote_block_ids", ((3, 4), (9,))),
    ("remote_request_id", "cmpl-2"), ("kvferry_agent_name", "kvferry-x"),
    ("kvferry_num_tokens", 41), ("kvferry_lease_s", 300.0), ("kvferry_prompt_hash", "1" * 32),
    ("kvferry_expires_at", int(NOW) + 3600), ("do_remote_prefill", False),
    ("kvferry_encoder_hash", "ab" * 16), ("kvferry_num_encoder_tokens", 12),
])
def test_any_changed_field_breaks_the_signature(field: str, value: object) -> None:
    forged = dataclasses.replace(sign_params(PARAMS, TEST_KEY, NOW), **{field: value})
    refusal = check_params(forged, TEST_KEY, NOW)
    assert refusal is not None and refusal.reason is FailureReason.BAD_SIGNATURE
    assert "kvferry_mac does not match" in refusal.message


def test_a_router_may_ask_for_a_hold_beside_signed_params() -> None:
    """`do_remote_decode` names nothing to contact: a prefill pod given an encoder pod's
    params with it pulls them and holds what it computes. Every other field stays signed."""
    wire = {**sign_params(PARAMS, TEST_KEY, NOW).to_dict(), "do_remote_decode": True}
    parsed = KVTransferParams.from_dict(wire)
    assert parsed is not None and parsed.do_remote_decode
    assert check_params(parsed, TEST_KEY, NOW) is None
    assert parsed.without_pull() == KVTransferParams(do_remote_decode=True)
    assert sign_params(PARAMS, TEST_KEY, NOW).without_pull() is None


def test_unsigned_params_and_another_keys_are_refused() -> None:
    refusal = check_params(PARAMS, TEST_KEY, NOW)
    assert refusal is not None and "carry no kvferry_mac" in refusal.message
    other = sign_params(PARAMS, TransferKey(b"o" * 32), NOW)
    assert check_params(other, TEST_KEY, NOW) is not None


@pytest.mark.parametrize(("text", "message"), [
    ("", "holds no KV transfer key"), ("  \n", "holds no KV transfer key"),
    ("x" * 31, "needs at least 32 bytes, this one has 31"),
])
def test_a_key_must_be_long_enough_and_the_error_never_shows_it(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        TransferKey.from_text(text, "$X")
    assert str(error.value).startswith("$X") and (not text.strip() or text not in str(error.value))
    # Surrounding whitespace (a file's newline) is not part of the key.
    assert TransferKey.from_text("  " + "k" * 32 + "\n", "$X").text == "k" * 32


def test_the_key_is_in_no_repr_and_reaches_a_child_by_environment() -> None:
    config = KVTransferConfig(transfer_key=TEST_KEY)
    assert TEST_KEY_TEXT not in repr(config) and TEST_KEY_TEXT not in repr(TEST_KEY)
    without, env = config.key_for_child()
    assert without.transfer_key is None and env == {KEY_ENV: TEST_KEY_TEXT}
    assert without.with_key_from(env).transfer_key == TEST_KEY
    assert key_from_environment({KEY_ENV: ""}) is None
    insecure = KVTransferConfig(insecure=True)
    assert insecure.key_for_child() == (insecure, {})
    assert insecure.with_key_from(env).transfer_key is None


def test_a_key_and_insecure_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="transfer_key and insecure exclude each other"):
        KVTransferConfig(transfer_key=TEST_KEY, insecure=True)
    assert not KVTransferConfig().may_transfer
    assert KVTransferConfig(insecure=True).may_transfer


def test_signing_costs_microseconds() -> None:
    """What a consumer pays per request, even for a long prompt (8k blocks)."""
    long = dataclasses.replace(PARAMS, remote_block_ids=(tuple(range(1, 8193)),))
    signed = sign_params(long, TEST_KEY, time.time())
    started = time.perf_counter()
    for _ in range(10):
        assert check_params(signed, TEST_KEY, time.time()) is None
    assert (time.perf_counter() - started) / 10 < 0.01
