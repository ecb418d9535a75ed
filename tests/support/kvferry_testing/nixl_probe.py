"""Reads an engine's KV blocks from outside it, as a consumer would: its handshake from the
side channel, then one NIXL READ per rank into this process's memory. For checking what
each rank of a parallel engine holds, whose caches live in its worker processes."""

from __future__ import annotations

import time
import uuid

import numpy as np
import torch
from kvferry.kvtransfer.layout import block_runs
from kvferry.kvtransfer.nixl_backend import GroupRead, NixlBackend
from kvferry.kvtransfer.side_channel import SideChannelClient


def read_rank_blocks(host: str, port: int, block_ids: list[int],
                     timeout_s: float = 10.0) -> list[list[bytes]]:
    """Per rank of the (insecure) engine serving its side channel at host:port, the bytes
    of each of `block_ids` in its first block group's cache."""
    info = SideChannelClient(host, port, timeout_s, reader="probe").handshake()
    ranks = list(zip(info.rank_agents, info.rank_agent_metadata, strict=True)) or [
        (info.agent_name, info.agent_metadata)]
    probe = NixlBackend(f"probe-{uuid.uuid4().hex[:8]}")
    try:
        result = []
        for rank, (name, metadata) in enumerate(ranks):
            layout, remote = info.layouts[rank], info.regions[rank]
            # Block 0 of the probe's buffer stays unused (ids start at 1, as an engine's).
            local_tensor = torch.zeros((len(block_ids) + 1, layout.block_bytes), dtype=torch.uint8)
            local = probe.register(local_tensor)
            probe.add_remote(metadata)
            runs = block_runs(np.arange(1, len(block_ids) + 1), np.asarray(block_ids))
            transfer = probe.read(name, [GroupRead(local, remote, layout.block_bytes, runs)], b"")
            deadline = time.monotonic() + timeout_s
            while (state := probe.poll(transfer)) == "PROC" and time.monotonic() < deadline:
                time.sleep(0.001)
            probe.release(transfer)
            assert state == "DONE", f"reading rank {rank}'s blocks: {state}"
            result.append([local_tensor[i].numpy().tobytes() for i in range(1, len(block_ids) + 1)])
        return result
    finally:
        probe.close()
