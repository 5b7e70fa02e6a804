"""A CPU engine's token budget per step (`entrypoints.engine_factory.engine_config`): 512 for a text model with
chunked prefill when none is given (at least max_num_seqs), the field's default elsewhere, and whatever was given
always."""

from __future__ import annotations

import pytest

from kestrel.config import SchedulerConfig
from kestrel.entrypoints import engine_factory
from kestrel.tiny import default_model_path

GPU_DEFAULT = SchedulerConfig().max_num_batched_tokens


def budget(**engine_args) -> int:
    return engine_factory.engine_config(str(default_model_path()), **engine_args).scheduler.max_num_batched_tokens


def test_cpu_text_model_gets_the_cpu_budget():
    assert budget(device="cpu") == engine_factory.CPU_MAX_NUM_BATCHED_TOKENS == 512
    assert budget(device="cpu", max_num_seqs=1000) == 1000  # every running request can still decode


@pytest.mark.parametrize("given", [256, 2048, 4096])
def test_a_given_budget_is_kept(given):
    assert budget(device="cpu", max_num_batched_tokens=given) == given


def test_other_cases_keep_the_field_default(monkeypatch):
    assert budget(device="cuda") == GPU_DEFAULT
    assert budget(device="cpu", enable_chunked_prefill=False) == GPU_DEFAULT
    monkeypatch.setattr(engine_factory, "model_modalities", lambda config: frozenset({"image"}))
    assert budget(device="cpu") == GPU_DEFAULT
