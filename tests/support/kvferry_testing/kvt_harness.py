"""Drives real NIXL between real processes: a producer subprocess, a consumer in the test.

`Producer` runs kvt_producer.py and talks to it over stdin/stdout; `Consumer` is a decode
engine's transfer layer over a zeroed cache in the test process. Every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kvferry.engine.core.kv_connector import FinishedTransfers, TransferFailure
from kvferry.kvtransfer import (
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferConfig,
    KVTransferMetrics,
    KVTransferParams,
)
from kvferry.kvtransfer.auth import KEY_ENV

from kvferry_testing.keys import TEST_KEY, TEST_KEY_TEXT

PRODUCER_MAIN = Path(__file__).with_name("kvt_producer.py")
# A small cache: 1 KiB blocks, so a test moves kilobytes, not megabytes.
SMALL = {"num_blocks": 64, "num_layers": 2, "block_size": 4, "num_kv_heads": 2,
         "head_size": 16, "dtype": "float16", "seed": 1}
# Seconds any single wait may take before the test fails instead of hanging.
WAIT_S = 20.0


def prompt(num_tokens: int) -> list[int]:
    """A prompt of the tokens the producer's holds were computed for (see kvt_producer)."""
    return [0] * num_tokens


def block_bytes(cache: torch.Tensor, ids: list[int]) -> bytes:
    """The raw bytes of some blocks (compared as bytes: random bits include NaNs)."""
    return cache[ids].reshape(-1).view(torch.uint8).numpy().tobytes()


class Producer:
    """One producer process; `call` sends a command and waits for its reply."""

    def __init__(self, spec: dict, log_path: Path, key_text: str = TEST_KEY_TEXT) -> None:
        self.spec = spec
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in kill)
        # The key travels as a pod's does: in the environment, not on the command line.
        self.proc = subprocess.Popen(
            [sys.executable, str(PRODUCER_MAIN), json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env={**os.environ, KEY_ENV: key_text},
        )
        hello = self._read_line()
        self.port: int = hello["port"]
        self.engine_id: str = hello["engine_id"]
        self.agent_name: str = hello["agent_name"]

    def _read_line(self) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], WAIT_S)
        if not ready:
            raise TimeoutError(f"producer did not answer within {WAIT_S} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"producer exited with {self.proc.wait(5)}")
        return json.loads(line)

    def call(self, op: str, **args: Any) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        return self._read_line()

    def hold(self, req_id: str, block_ids: list[list[int]], num_tokens: int) -> KVTransferParams:
        params = KVTransferParams.from_dict(
            self.call("hold", req_id=req_id, block_ids=block_ids, num_tokens=num_tokens)["params"]
        )
        assert params is not None
        return params

    def wait_ended(self, req_id: str, timeout: float = WAIT_S) -> dict:
        """Polls until the producer's hold on `req_id` ended; returns the last status."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.call("status")
            if req_id in status["ended"]:
                return status
            time.sleep(0.02)
        raise TimeoutError(f"the producer still holds {req_id} after {timeout} s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._log.close()



@dataclass
class Consumer:
    """A decode engine's transfer layer over a zeroed cache, driven step by step."""

    worker: KVConnectorWorker
    scheduler: KVConnectorScheduler
    caches: list[torch.Tensor]
    metrics: KVTransferMetrics
    block_size: int
    # Everything get_finished reported so far.
    done: FinishedTransfers = field(default_factory=FinishedTransfers)

    def step(self) -> None:
        self.worker.apply(self.scheduler.build_connector_meta())
        finished = self.scheduler.get_finished(self.worker.get_finished())
        self.done.ready.extend(finished.ready)
        self.done.failed.update(finished.failed)
        self.done.free.extend(finished.free)

    def start_pull(self, req_id: str, params: KVTransferParams,
                   local_block_ids: list[list[int]], num_prompt_tokens: int) -> int:
        """Admits a request whose prompt KV is remote; returns the tokens it will pull."""
        self.scheduler.add_request(req_id, params)
        num_external = self.scheduler.get_num_new_matched_tokens(params, prompt(num_prompt_tokens), 0)
        self.scheduler.update_state_after_alloc(req_id, params, local_block_ids, 0, num_external)
        return num_external

    def wait(self, req_id: str, timeout: float = WAIT_S) -> TransferFailure | None:
        """Steps until the pull is over: None when ready, else its failure."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.step()
            if req_id in self.done.ready:
                return None
            if req_id in self.done.failed:
                return self.done.failed[req_id]
            time.sleep(0.002)
        raise TimeoutError(f"pull of {req_id} neither finished nor failed within {timeout} s")

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()

    def pull(self, req_id: str, params: KVTransferParams, local_block_ids: list[list[int]],
             num_prompt_tokens: int) -> TransferFailure | None:
        self.start_pull(req_id, params, local_block_ids, num_prompt_tokens)
        return self.wait(req_id)


_CONFIG_FIELDS = ("lease_s", "heartbeat_interval_s", "side_channel_timeout_s", "pull_timeout_s",
                  "model_id", "read_threads", "read_split_min_bytes", "transfer_key",
                  "side_channel_connect_timeout_s", "max_prepares_per_producer")


def make_consumer_on(spec: dict, num_groups: int) -> Consumer:
    """A consumer whose caches have `spec`'s layout; config fields in `spec` configure it
    (the tests' shared key unless `transfer_key` is given)."""
    fields = {k: spec[k] for k in _CONFIG_FIELDS if k in spec}
    config = KVTransferConfig(**{"model_id": "test-model", "transfer_key": TEST_KEY, **fields})
    metrics = KVTransferMetrics()
    worker = KVConnectorWorker(config, metrics)
    caches = [zero_cache(spec) for _ in range(num_groups)]
    endpoint = worker.register_kv_caches(caches)
    scheduler = KVConnectorScheduler(config, spec["block_size"], endpoint, worker.leases, metrics)
    return Consumer(worker, scheduler, caches, metrics, spec["block_size"])


def zero_cache(spec: dict) -> torch.Tensor:
    shape = (spec["num_blocks"], spec["num_layers"], 2, spec["block_size"],
             spec["num_kv_heads"], spec["head_size"])
    return torch.zeros(shape, dtype=getattr(torch, spec["dtype"]))


