"""The grammar workers' default (`grammar_workers` unset): processes for one GPU in the engine's process, none
elsewhere; an explicit count, 0 included, is taken as given (a negative one is refused by name:
tests/e2e/test_grammar_workers.py)."""

from __future__ import annotations

import os

from kestrel.config import EngineConfig
from kestrel.structured import shards


def test_unset_means_half_the_cores_up_to_eight_on_a_gpu_host_and_none_elsewhere(monkeypatch):
    assert EngineConfig.__dataclass_fields__["grammar_workers"].default is None
    assert shards.default_grammar_workers(False) == 0
    for cores, expected in ((16, 8), (64, 8), (6, 3), (2, 1), (1, 0)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert shards.default_grammar_workers(True) == expected


def test_the_backend_takes_an_explicit_count_and_resolves_an_unset_one(monkeypatch):
    built = []
    monkeypatch.setattr(shards, "GrammarShards", lambda *args, **kwargs: built.append(args[3]) or "shards")
    monkeypatch.setattr(shards, "GrammarBackend", lambda *args, **kwargs: "thread")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert shards.grammar_backend(None, 10, frozenset(), None, 4, gpu_host=True) == "shards" and built == [8]
    assert shards.grammar_backend(None, 10, frozenset(), None, 4, gpu_host=False) == "thread"
    assert shards.grammar_backend(None, 10, frozenset(), 0, 4, gpu_host=True) == "thread"
    assert shards.grammar_backend(None, 10, frozenset(), 3, 4, gpu_host=False) == "shards" and built == [8, 3]
