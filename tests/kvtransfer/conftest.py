"""Fixtures that start producer processes and consumers, and always clean them up."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvferry_testing.kvt_harness import SMALL, Consumer, Producer, make_consumer_on

# Children inherit this; UCX logs a line per refused connection otherwise.
os.environ.setdefault("UCX_LOG_LEVEL", "fatal")


@pytest.fixture
def producers(tmp_path: Path) -> Iterator[Any]:
    """start(**spec overrides) -> Producer; every producer is killed after the test."""
    started: list[Producer] = []

    def start(**overrides: Any) -> Producer:
        producer = Producer({**SMALL, **overrides}, tmp_path / "producer.log")
        started.append(producer)
        return producer

    yield start
    for producer in started:
        producer.kill()


@pytest.fixture
def make_consumer() -> Iterator[Any]:
    """make(num_groups=1, **spec and config overrides) -> Consumer; shut down after the test."""
    built: list[Consumer] = []

    def make(num_groups: int = 1, **overrides: Any) -> Consumer:
        consumer = make_consumer_on({**SMALL, **overrides}, num_groups)
        built.append(consumer)
        return consumer

    yield make
    for consumer in built:
        consumer.close()
