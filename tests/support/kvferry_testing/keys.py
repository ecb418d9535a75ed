"""The KV transfer key the tests' pods share, as every pod of one service does."""

from __future__ import annotations

import time
from typing import Any

from kvferry.kvtransfer.auth import KEY_ENV, TransferKey, sign_params
from kvferry.kvtransfer.params import KVTransferParams

TEST_KEY_TEXT = "kvferry-tests-transfer-key-0123456789abcdef"
TEST_KEY = TransferKey(TEST_KEY_TEXT.encode())
# The environment of a `kvferry serve` that holds the key.
KEYED_ENV = {KEY_ENV: TEST_KEY_TEXT}


def resigned(params: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A producer's params with `changes`, signed again with the tests' key: what only a
    holder of the key can make (a test standing in for a pod of the service)."""
    parsed = KVTransferParams.from_dict({**params, **changes})
    assert parsed is not None
    return sign_params(parsed, TEST_KEY, time.time()).to_dict()
