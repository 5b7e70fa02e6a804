"""The decode-path launch changes are off on a GPU until its table turns them on, and on off CUDA (the tests)."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels import common


@pytest.fixture(autouse=True)
def fresh_feature_cache():
    common._features_on.cache_clear()
    yield
    common._features_on.cache_clear()


def test_every_feature_is_on_off_cuda_and_off_on_an_untuned_gpu(monkeypatch):
    for name in common.LAUNCH_FEATURES:
        assert common.launch_feature(name, torch.device("cpu"))
    monkeypatch.setattr(common, "gpu_table", lambda kernel, device: {})
    for name in common.LAUNCH_FEATURES:
        assert not common.launch_feature(name, torch.device("cuda", 0))


def test_a_gpu_table_turns_on_only_what_it_names_true(monkeypatch):
    tables = {"decode_launches": {"pdl_decode": True, "moe_k_sum": False, "rope_head_norms": "true"}}
    monkeypatch.setattr(common, "gpu_table", lambda kernel, device: tables.get(kernel, {}))
    cuda = torch.device("cuda", 0)
    on = {name for name in common.LAUNCH_FEATURES if common.launch_feature(name, cuda)}
    assert on == {"pdl_decode"}


def test_an_unknown_feature_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown launch feature 'pdl'.*pdl_decode"):
        common.launch_feature("pdl", torch.device("cpu"))
