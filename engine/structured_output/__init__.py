"""Structured outputs: constraints on the output text (JSON schemas, regexes, choices,
grammars) enforced token by token with llguidance (grammar.py), and the engine core's
per-request matchers and per-step bitmasks (manager.py)."""
