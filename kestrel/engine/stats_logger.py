"""The engine's periodic log line, as vLLM prints it: prompt and generation throughput over the last interval,
running and waiting requests, KV cache usage and the prefix-cache hit rate."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("kestrel.engine")


class StatsLogger:
    def __init__(self, interval_s: float = 10.0, log: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._log = log or logger.info
        self._clock = clock
        self._last_time = clock()
        self._last = (0, 0, 0, 0)  # prompt tokens, generation tokens, prefix queries, prefix hits

    def maybe_log(self, scheduler: Any, force: bool = False) -> str | None:
        """Log (and return) the line when the interval has passed, or when `force` and anything happened."""
        now = self._clock()
        elapsed = now - self._last_time
        stats, kv = scheduler.stats, scheduler.kv
        current = (stats.num_prompt_tokens, stats.num_generation_tokens, kv.prefix_queries, kv.prefix_hits)
        if elapsed <= 0 or (elapsed < self.interval_s and not force) or (force and current == self._last):
            return None
        prompt, generated, queries, hits = (a - b for a, b in zip(current, self._last))
        line = (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, Avg generation throughput: "
                f"{generated / elapsed:.1f} tokens/s, Running: {scheduler.num_running} reqs, Waiting: "
                f"{scheduler.num_waiting} reqs, KV cache usage: {kv.usage * 100:.1f}%, Prefix cache hit rate: "
                f"{(hits / queries * 100) if queries else 0.0:.1f}%")
        self._log(line)
        self._last_time, self._last = now, current
        return line
