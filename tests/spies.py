"""Spies for tests: a function that still runs, with each call recorded."""

from __future__ import annotations

from typing import Any


def record_calls(monkeypatch: Any, owner: Any, name: str) -> list[tuple[tuple, dict]]:
    """`owner.name` still runs, and each call's (args, kwargs) is appended to the returned list."""
    calls = []
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls
