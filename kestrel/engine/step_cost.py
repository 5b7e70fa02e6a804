"""The measured cost of a step, for the scheduler's time budget (`SchedulerConfig.step_time_target_ms`).

A step's time is modelled as `fixed + per_token * tokens`, fitted by least squares over the latest steps: the time
between consecutive steps' results while the engine stays busy, which is what a decoding request waits between its
tokens. From it the scheduler takes the most tokens a step may carry to stay within the target.
"""

from __future__ import annotations

from collections import deque

# Steps the fit remembers: enough to hold a few prefill steps among the decode steps of a busy batch, few enough
# to follow a batch whose contexts grow.
FIT_WINDOW = 128


class StepCostModel:
    def __init__(self, window: int = FIT_WINDOW) -> None:
        self._steps: deque[tuple[int, float]] = deque()
        self._window = window
        # Running sums over the window (tokens, seconds, tokens^2, tokens * seconds): the fit is read every step.
        self._sums: list[float] = [0, 0.0, 0, 0.0]

    @property
    def num_observations(self) -> int:
        return len(self._steps)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        self._steps.append((num_tokens, seconds))
        self._add(num_tokens, seconds, 1)
        if len(self._steps) > self._window:
            self._add(*self._steps.popleft(), -1)

    def _add(self, tokens: int, seconds: float, sign: int) -> None:
        sums = self._sums
        sums[0] += sign * tokens
        sums[1] += sign * seconds
        sums[2] += sign * tokens * tokens
        sums[3] += sign * tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token): the least-squares line where the steps seen have two sizes or more
        and their time grows with their tokens; otherwise (one size, or times that noise has made fall with the
        tokens) their time as if all of it grew with the tokens: no fixed part, an overestimate per token, so the
        next budget is smaller, never larger. None before any step."""
        n = len(self._steps)
        if n == 0:
            return None
        tokens, seconds, tokens_sq, tokens_seconds = self._sums
        spread = n * tokens_sq - tokens * tokens  # exact: the token sums are integers
        per_token = (n * tokens_seconds - tokens * seconds) / spread if spread > 0 else 0.0
        if per_token <= 0:
            return 0.0, seconds / tokens
        return max((seconds - per_token * tokens) / n, 0.0), per_token

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step can carry and take at most `seconds` by the fit (0 when even an empty step would
        not); None without a fit."""
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, per_token = fitted
        return max(int((seconds - fixed) / per_token), 0)
