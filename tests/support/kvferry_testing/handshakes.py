"""A producer's handshake as the side channel serves it, for tests that need one without NIXL."""

from __future__ import annotations

from kvferry.kvtransfer.layout import KVLayout, RegionInfo, compatibility_hash
from kvferry.kvtransfer.params import TRANSFER_PROTOCOL_VERSION
from kvferry.kvtransfer.side_channel import HandshakeInfo

LAYOUT = KVLayout(block_size=4, num_layers=2, num_kv_heads=2, head_size=16, dtype="float16",
                  element_size=2)


def handshake_info(model_id: str = "m", layout: KVLayout = LAYOUT) -> HandshakeInfo:
    return HandshakeInfo(
        protocol_version=TRANSFER_PROTOCOL_VERSION, engine_id="e1", agent_name="agent-1",
        agent_metadata=b"\x00nixl", model_id=model_id, layouts=[layout],
        regions=[RegionInfo(base_addr=4096, num_blocks=64, device_id=0, mem_type="DRAM")],
        compat_hash=compatibility_hash(model_id, [layout]), lease_s=30.0,
    )
