"""Which graphs a GPU test's engine replayed."""

from __future__ import annotations

from typing import Any


def record_replays(graph_runner: Any, method: str) -> list[tuple[int, int]]:
    """The key of every call of `graph_runner.<method>` (`_replay` or `_replay_prefill`) from now on, in order; each
    call still replays."""
    keys: list[tuple[int, int]] = []
    replay = getattr(graph_runner, method)

    def recording(key: tuple[int, int]) -> None:
        keys.append(key)
        replay(key)

    setattr(graph_runner, method, recording)
    return keys
