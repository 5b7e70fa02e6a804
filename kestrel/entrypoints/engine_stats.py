"""The engine's stats as /metrics reports them: a snapshot taken after each step by whoever runs the engine core
(the server's engine thread, or the engine core process, which ships it to the server with each step)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot published by the engine's runner; counters are totals since start."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # Tokens per engine step (vLLM's iteration_tokens_total): cumulative counts at ITERATION_TOKEN_BUCKETS.
    iteration_buckets: tuple[int, ...] = ()
    iteration_count: int = 0
    iteration_sum: int = 0
    # Speculative decoding (vLLM's spec_decode series): verify steps, draft tokens, accepted ones (by position).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # expert_load_metrics: {MoE layer index: tokens routed to each expert}, as of the runner's latest report.
    expert_load: dict[int, list[int]] = field(default_factory=dict)

    def to_wire(self) -> list[Any]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @classmethod
    def from_wire(cls, values: list[Any]) -> EngineStats:
        stats = cls(*values)
        object.__setattr__(stats, "iteration_buckets", tuple(stats.iteration_buckets))
        object.__setattr__(stats, "spec_accepted_per_position", tuple(stats.spec_accepted_per_position))
        return stats


class StatsTracker:
    """Counts each step's tokens into the iteration histogram and snapshots the scheduler's counters."""

    def __init__(self) -> None:
        self._buckets = [0] * len(ITERATION_TOKEN_BUCKETS)
        self._count = self._sum = 0
        self._scheduled_before = 0

    def count_step(self, scheduler: Any) -> None:
        total = scheduler.stats.num_scheduled_tokens
        tokens, self._scheduled_before = total - self._scheduled_before, total
        if tokens <= 0:
            return
        self._count += 1
        self._sum += tokens
        for i, bound in enumerate(ITERATION_TOKEN_BUCKETS):
            if tokens <= bound:
                self._buckets[i] += 1

    def snapshot(self, scheduler: Any) -> EngineStats:
        stats = scheduler.stats
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=scheduler.kv.usage,
            prefix_cache_queries=scheduler.kv.prefix_queries,
            prefix_cache_hits=scheduler.kv.prefix_hits,
            num_preemptions=stats.num_preemptions,
            num_prompt_tokens=stats.num_prompt_tokens,
            num_generation_tokens=stats.num_generation_tokens,
            iteration_buckets=tuple(self._buckets),
            iteration_count=self._count,
            iteration_sum=self._sum,
            spec_num_drafts=stats.num_spec_drafts,
            spec_num_draft_tokens=stats.num_spec_draft_tokens,
            spec_num_accepted_tokens=stats.num_spec_accepted_tokens,
            spec_accepted_per_position=tuple(stats.spec_accepted_per_position),
            expert_load=stats.expert_load,
        )
