"""A producer engine's transfer layer in its own process, driven over stdin/stdout.

Started by the tests as `python producer_main.py '<json spec>'`. It registers a KV cache
filled with seeded random bytes, serves its side channel, prints one JSON line with its
endpoint, then answers one JSON command per line:

    {"op": "hold", "req_id", "block_ids", "num_tokens"} -> {"params": {...}}
    {"op": "status"} -> {"ended": [...], "blocks_held", "readers": {req_id: consumer}, "stats"}
    {"op": "digest", "group", "block_ids"} -> {"sha256": [...]}
    {"op": "exit"}

Between commands it runs the worker's `get_finished` every 10 ms, as an engine loop would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import select
import sys

import torch
from kvferry.kvtransfer import (
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferConfig,
    KVTransferMetrics,
    KVTransferParams,
)
from kvferry.kvtransfer.auth import KEY_ENV, TransferKey

# The token every prompt of the transfer tests is made of.
PROMPT_TOKEN = 0


def fill_cache(spec: dict, group: int) -> torch.Tensor:
    """The producer's cache of one group: seeded random bytes, reproducible in the test."""
    shape = (spec["num_blocks"], spec["num_layers"], 2, spec["block_size"],
             spec["num_kv_heads"], spec["head_size"])
    dtype = getattr(torch, spec["dtype"])
    cache = torch.empty(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(spec["seed"] * 10 + group)
    raw = torch.randint(0, 256, (cache.numel() * cache.element_size(),), generator=gen,
                        dtype=torch.uint8)
    cache.view(-1).view(torch.uint8).copy_(raw)
    return cache


def main() -> None:
    # NIXL logs to stdout: replies keep a private copy of it, and fd 1 goes to stderr.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    spec = json.loads(sys.argv[1])
    config = KVTransferConfig(
        engine_id=spec.get("engine_id"), model_id=spec.get("model_id", "test-model"),
        side_channel_port=spec.get("port", 0), lease_s=spec.get("lease_s", 30.0),
        transfer_key=TransferKey.from_text(os.environ[KEY_ENV], KEY_ENV),
    )
    caches = [fill_cache(spec, g) for g in range(spec.get("num_groups", 1))]
    metrics = KVTransferMetrics()
    worker = KVConnectorWorker(config, metrics)
    endpoint = worker.register_kv_caches(caches)
    scheduler = KVConnectorScheduler(config, spec["block_size"], endpoint, worker.leases, metrics)
    print(json.dumps({"port": endpoint.port, "engine_id": endpoint.engine_id,
                      "agent_name": endpoint.agent_name}), file=replies)
    ended: list[str] = []
    while True:
        ended.extend(worker.get_finished().finished_sends)
        ready, _, _ = select.select([sys.stdin], [], [], 0.01)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            break
        command = json.loads(line)
        if command["op"] == "exit":
            break
        reply = handle(command, scheduler, worker, caches, ended)
        print(json.dumps(reply), file=replies)
    worker.shutdown()


def handle(command: dict, scheduler: KVConnectorScheduler, worker: KVConnectorWorker,
           caches: list[torch.Tensor], ended: list[str]) -> dict:
    op = command["op"]
    if op == "hold":
        params = KVTransferParams.from_dict({"do_remote_decode": True})
        # The held prompt is PROMPT_TOKEN repeated; consumers in the tests send the same.
        prompt = [PROMPT_TOKEN] * command["num_tokens"]
        keep, out = scheduler.request_finished(
            command["req_id"], params, command["block_ids"], prompt, command["num_tokens"],
            aborted=False,
        )
        assert keep and out is not None
        return {"params": out}
    if op == "status":
        stats = dataclasses.asdict(worker.metrics.snapshot())
        return {"ended": ended, "blocks_held": worker.leases.num_blocks_held,
                "readers": worker.leases.readers(), "stats": stats}
    if op == "digest":
        cache = caches[command["group"]]
        blocks = [cache[b].reshape(-1).view(torch.uint8).numpy() for b in command["block_ids"]]
        return {"sha256": [hashlib.sha256(b.tobytes()).hexdigest() for b in blocks]}
    raise ValueError(f"unknown op {op!r}")


if __name__ == "__main__":
    main()
