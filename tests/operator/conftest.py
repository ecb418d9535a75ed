"""Makes the operator tests' helper modules importable, and shares the helm fixture."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from chart import helm_binary  # noqa: E402


@pytest.fixture(scope="session")
def helm() -> str:
    """Path of a working helm binary."""
    return helm_binary()
