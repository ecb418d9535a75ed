"""The OpenAI-compatible HTTP server of `kvferry serve` (FastAPI over AsyncLLM)."""
