"""The grammar workers' default (`grammar_workers` unset): processes for one GPU in the engine's process, none
elsewhere; an explicit count, 0 included, is taken as given (a negative one is refused by name:
tests/e2e/test_grammar_workers.py)."""

from __future__ import annotations

import os

import pytest

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


def test_the_fork_server_starts_before_the_model_loads_only_for_an_engine_with_workers(monkeypatch):
    from types import SimpleNamespace

    from kestrel.entrypoints import engine_factory

    started = []
    monkeypatch.setattr(shards, "start_fork_server", lambda modules: started.append(modules))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    for workers, uses_workers, on_cuda, expected in ((None, False, True, 1), (None, False, False, 0),
                                                     (None, True, True, 0), (0, False, True, 0),
                                                     (2, False, False, 1)):
        started.clear()
        config = SimpleNamespace(grammar_workers=workers, parallel=SimpleNamespace(uses_workers=uses_workers))
        shards.start_grammar_workers_early(config, on_cuda)
        assert started == [shards.WORKER_MODULES] * expected, (workers, uses_workers, on_cuda)

    order = []

    class StopAtTheRunner(Exception):
        pass

    def runner(*args, **kwargs):
        order.append("model runner")
        raise StopAtTheRunner

    monkeypatch.setattr(engine_factory, "start_grammar_workers_early",
                        lambda config, on_cuda: order.append(("fork server", on_cuda)))
    monkeypatch.setattr(engine_factory, "ModelRunner", runner)
    config = SimpleNamespace(device="cpu", parallel=SimpleNamespace(uses_workers=False),
                             model=SimpleNamespace(hf_config={}))
    with pytest.raises(StopAtTheRunner):
        engine_factory.build_engine_core(config, None, None)
    assert order == [("fork server", False), "model runner"]
