"""Test support shared by tests/, e2e/ and benchmarks/: fake engine pods, process and
server helpers, the Kubernetes API emulator wrapper, InferenceService factories.

It is not part of the `kvferry` distribution. pytest puts `tests/support` on the path
(`pythonpath` in pyproject.toml); a benchmark script adds it itself.
"""
