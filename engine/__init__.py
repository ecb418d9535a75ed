"""The per-pod engine: scheduler, KV cache, model runner, models, attention, sampler, server, CLI."""
