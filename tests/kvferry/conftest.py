"""Fixtures of the package root's tests: random-weight checkpoints for `kvferry generate`."""

from kvferry_testing.checkpoints import make_checkpoint  # noqa: F401 (fixture)
