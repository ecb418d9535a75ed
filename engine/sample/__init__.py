"""Sampling: per-step metadata, logits processing (penalties, filters) and the sampler."""

from kvferry.engine.sample.metadata import SamplingMetadata
from kvferry.engine.sample.sampler import LogprobsTensors, Sampler, SamplerOutput

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata"]
