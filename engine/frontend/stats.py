"""Engine statistics, kept per step and cumulatively (the server exports them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.engine.core.messages import SchedulerStats


@dataclass
class IterationStats:
    """What happened in one step."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # Seconds from arrival to first token, for requests that got it this step.
    time_to_first_tokens: list[float] = field(default_factory=list)
    # Seconds between consecutive tokens, for every token after a request's first.
    inter_token_latencies: list[float] = field(default_factory=list)
    # Seconds from arrival to finish, with each finished request's finish reason.
    e2e_latencies: list[float] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    # Seconds from arrival until first scheduled, for requests first scheduled this step.
    queue_times: list[float] = field(default_factory=list)


@dataclass
class EngineStats:
    """Cumulative counters plus the latest step's scheduler and iteration stats."""

    scheduler: SchedulerStats = field(default_factory=SchedulerStats)
    last_iteration: IterationStats = field(default_factory=IterationStats)
    num_steps: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_finished_requests: int = 0
    # Encoder positions run (encoder-decoder models).
    encoder_tokens_total: int = 0

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        self.scheduler = scheduler
        self.last_iteration = iteration
        self.num_steps += 1
        self.encoder_tokens_total += scheduler.num_step_encoder_tokens
        self.prompt_tokens_total += iteration.num_prompt_tokens
        self.generation_tokens_total += iteration.num_generation_tokens
        self.num_finished_requests += len(iteration.e2e_latencies)

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.scheduler.prefix_cache_queries
        return self.scheduler.prefix_cache_hits / queries if queries else 0.0
