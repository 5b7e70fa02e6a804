"""The requests waiting for admission, kept in the order the scheduling policy admits them (pure Python).

- fcfs: arrival order; a preempted request goes back to the front.
- priority: (priority, arrival); a preempted request takes its place by the same key.
- shortest_prefill: within a priority, the request with the fewest prompt tokens to compute first, so that a
  burst of long prompts does not hold every short one behind it (TTFT's tail under load comes from that queue).
  Two kinds of request jump the order, and go oldest first among themselves: one preempted (it was already
  running; its recomputation resumes first, as under fcfs) and one starving: once `starvation_bound` requests
  have been admitted since a request arrived, it goes before every request of its priority that has not waited
  as long. Only the oldest waiting request can
  be the next to starve, so the check costs O(1) per admission.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from kestrel.request import Request

# Under shortest_prefill, a request that jumps the length order (preempted or starving) sorts in tier 0.
_FIRST, _BY_LENGTH = 0, 1


class WaitingQueue:
    def __init__(self, policy: str, starvation_bound: int | None = None) -> None:
        self.policy = policy
        self._starvation_bound = starvation_bound
        self._queue: deque[Request] = deque()
        # shortest_prefill's bookkeeping: each waiting request's sort key (fixed while it waits), the admissions
        # counted when it arrived, and the waiting requests in arrival order (entries that left are skipped).
        self._keys: dict[str, tuple[int, int, int, float]] = {}
        self._admissions = 0
        self._arrived_after: dict[str, int] = {}
        self._by_arrival: deque[Request] = deque()

    # ----- what the scheduler reads ---------------------------------------------------------

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __getitem__(self, index: int) -> Request:
        return self._queue[index]

    # ----- changes --------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """A new request."""
        if self.policy == "fcfs":
            self._queue.append(request)
        elif self.policy == "priority":
            bisect.insort(self._queue, request, key=_priority_key)
        else:
            self._arrived_after[request.request_id] = self._admissions
            self._by_arrival.append(request)
            self._insert(request, _BY_LENGTH)

    def add_preempted(self, request: Request) -> None:
        """A request taken off the running batch, to be recomputed."""
        if self.policy == "fcfs":
            self._queue.appendleft(request)
        elif self.policy == "priority":
            bisect.insort(self._queue, request, key=_priority_key)
        else:
            self._insert(request, _FIRST)

    def pop_head(self) -> Request:
        """The head is admitted."""
        request = self._queue.popleft()
        if self.policy == "shortest_prefill":
            self._forget(request)
            self._admissions += 1
            self._promote_starving()
        return request

    def remove(self, request: Request) -> None:
        """The request finished or was aborted while waiting."""
        self._queue.remove(request)
        if self.policy == "shortest_prefill":
            self._forget(request)

    # ----- shortest_prefill -----------------------------------------------------------------

    def _insert(self, request: Request, tier: int) -> None:
        # The requests that jump the length order go oldest first among themselves, as under fcfs.
        length = request.num_tokens - request.num_computed_tokens if tier == _BY_LENGTH else 0
        key = (request.priority, tier, length, request.arrival_time)
        self._keys[request.request_id] = key
        bisect.insort(self._queue, request, key=lambda r: self._keys[r.request_id])

    def _forget(self, request: Request) -> None:
        del self._keys[request.request_id]
        self._arrived_after.pop(request.request_id, None)

    def _promote_starving(self) -> None:
        while self._by_arrival:
            oldest = self._by_arrival[0]
            if oldest.request_id not in self._keys or self._keys[oldest.request_id][1] == _FIRST:
                self._by_arrival.popleft()  # admitted, finished, or already first: no longer the one to watch
                continue
            if self._admissions - self._arrived_after[oldest.request_id] < self._starvation_bound:
                return
            self._by_arrival.popleft()
            self._queue.remove(oldest)
            del self._keys[oldest.request_id]
            self._insert(oldest, _FIRST)


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority_key
