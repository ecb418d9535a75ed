"""KVTransferConfig validates on construction, naming the field."""

from __future__ import annotations

import pytest
from kvferry.kvtransfer import KVTransferConfig


def test_defaults_hold_for_thirty_seconds_and_beat_three_times_per_lease() -> None:
    config = KVTransferConfig()
    assert (config.lease_s, config.heartbeat_s) == (30.0, 10.0)
    assert (config.failure_policy, config.ucx_error_handling_mode) == ("recompute", "none")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"engine_id": ""}, "engine_id"),
        ({"side_channel_port": 70000}, "side_channel_port"),
        ({"lease_s": 0}, "lease_s"),
        ({"lease_s": 1.0, "heartbeat_interval_s": 1.0}, "heartbeat_interval_s"),
        ({"side_channel_timeout_s": 0}, "side_channel_timeout_s"),
        ({"pull_timeout_s": -1}, "pull_timeout_s"),
        ({"read_threads": 0}, "read_threads"),
        ({"read_threads": 17}, "read_threads"),
        ({"read_split_min_bytes": -1}, "read_split_min_bytes"),
        ({"failure_policy": "retry"}, "failure_policy"),
        ({"ucx_error_handling_mode": "thread"}, "ucx_error_handling_mode"),
        ({"ucx_net_devices": ""}, "ucx_net_devices"),
        ({"ucx_net_devices": "lo, eth0"}, "ucx_net_devices"),
    ],
)
def test_bad_fields_are_refused_by_name(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVTransferConfig(**fields)
