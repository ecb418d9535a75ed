"""The operator tests' shared helm fixture."""

import pytest
from kvferry_testing.chart import helm_binary


@pytest.fixture(scope="session")
def helm() -> str:
    """Path of a working helm binary."""
    return helm_binary()
