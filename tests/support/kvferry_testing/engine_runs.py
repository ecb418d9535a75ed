"""Driving an `LLMEngine` by hand in the transfer tests: one request stepped to its end,
and an engine stepped until every block is free again (its holds pulled or expired)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kvferry.engine.frontend.llm_engine import LLMEngine
from kvferry.engine.frontend.outputs import RequestOutput

from kvferry import SamplingParams


def run_one(engine: LLMEngine, request_id: str, prompt: Any, params: SamplingParams,
            timeout_s: float = 60.0, **kwargs: Any) -> RequestOutput:
    """Adds one request (`kwargs` as `add_request` takes them) and steps the engine until
    it finishes; its last output."""
    engine.add_request(request_id, prompt, params, **kwargs)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output
    pytest.fail(f"{request_id} did not finish")


def drain(engine: LLMEngine, timeout_s: float = 15.0) -> None:
    """Steps the engine until all its blocks but the null block are free; fails if not."""
    manager = engine.engine_core.kv_cache_manager
    every = manager.block_pool.num_blocks - 1
    deadline = time.monotonic() + timeout_s
    while manager.num_free_blocks != every and time.monotonic() < deadline:
        engine.step()
    assert manager.num_free_blocks == every
