"""A model with two KV-cache groups end to end on CPU: a tiny Qwen2 whose first layer attends fully and whose second
has a sliding window (`use_sliding_window`, `max_window_layers`) matches HF transformers greedy, also under
chunked prefill, preemption and prefix caching; today's families keep one group."""

from __future__ import annotations

import random

import pytest
from test_generate import hf_greedy, kestrel_greedy, mixed_prompts

from kestrel import LLM
from kestrel.kv_spec import FullAttentionSpec, SlidingWindowSpec
from kestrel.loader.model_init import write_tiny_checkpoint

WINDOW = 8


@pytest.fixture(scope="module")
def mixed_window_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen2-mixed-window")
    write_tiny_checkpoint(str(path), arch="qwen2", seed=4, tie_word_embeddings=False, use_sliding_window=True,
                          sliding_window=WINDOW, max_window_layers=1)
    return str(path)


@pytest.fixture(scope="module")
def expected(mixed_window_dir: str) -> tuple[list[list[int]], list[list[int]]]:
    prompts = mixed_prompts(1000, seed=7)
    return prompts, hf_greedy(mixed_window_dir, prompts)


def test_two_groups_are_reported_and_bound(mixed_window_dir: str) -> None:
    llm = LLM(mixed_window_dir, dtype="float32", max_model_len=64, kv_cache_blocks=40)
    layout = llm.runner.kv_layout
    assert [g.spec for g in layout.groups] == [FullAttentionSpec(2, 16), SlidingWindowSpec(2, 16, window=WINDOW)]
    assert [g.layer_indices for g in layout.groups] == [(0,), (1,)] and layout.num_blocks == (40, 40)
    assert [layer.kv_group for layer in llm.runner.model.attention_layers()] == [0, 1]
    assert [len(pool.blocks) for pool in llm.engine.scheduler.kv.pools] == [40, 40]


def test_greedy_matches_hf(mixed_window_dir: str, expected) -> None:
    prompts, reference = expected
    llm = LLM(mixed_window_dir, dtype="float32", max_model_len=64)
    assert kestrel_greedy(llm, prompts) == reference


def test_chunking_preemption_and_prefix_caching_keep_outputs(mixed_window_dir: str, expected) -> None:
    prompts, reference = expected
    chunked = LLM(mixed_window_dir, dtype="float32", max_model_len=64, max_num_batched_tokens=8, max_num_seqs=8)
    assert kestrel_greedy(chunked, prompts) == reference
    tight = LLM(mixed_window_dir, dtype="float32", max_model_len=64, kv_cache_blocks=6, max_num_seqs=16)
    assert kestrel_greedy(tight, prompts) == reference
    assert tight.stats.num_preemptions > 0
    assert all(p.num_free_blocks == p.num_blocks for p in tight.engine.scheduler.kv.pools)

    rng = random.Random(5)
    shared = [rng.randrange(3, 1000) for _ in range(40)]
    first = [shared + [rng.randrange(3, 1000) for _ in range(5)] for _ in range(3)]
    second = [shared + [rng.randrange(3, 1000) for _ in range(7)] for _ in range(3)]
    cached = LLM(mixed_window_dir, dtype="float32", max_model_len=64)
    kestrel_greedy(cached, first)
    before = cached.stats.num_scheduled_tokens
    assert kestrel_greedy(cached, second) == hf_greedy(mixed_window_dir, second)
    # Each second prompt finds the two full blocks of the shared tokens in both groups: it computes 47 - 32 prompt
    # tokens, then decodes 9.
    assert cached.stats.num_scheduled_tokens - before <= 3 * (47 - 32) + 3 * 9


def test_pipeline_stages_report_every_stages_groups(mixed_window_dir: str, expected) -> None:
    """With pp = 2 each stage holds one of the two layers, so one group each: both report the model's two groups."""
    prompts, reference = expected
    llm = LLM(mixed_window_dir, dtype="float32", max_model_len=64, pipeline_parallel_size=2)
    layout = llm.engine.scheduler.kv.layout
    assert [g.spec.kind for g in layout.groups] == ["full", "sliding_window"]
    assert kestrel_greedy(llm, prompts[:6]) == reference[:6]


@pytest.mark.parametrize(("arch", "overrides", "spec"), [
    ("llama", {}, FullAttentionSpec(2, 16)),
    ("mistral", {"sliding_window": WINDOW}, SlidingWindowSpec(2, 16, window=WINDOW)),
    ("qwen2", {}, FullAttentionSpec(2, 16)),
])
def test_todays_families_have_one_group(tmp_path, arch: str, overrides: dict, spec) -> None:
    write_tiny_checkpoint(str(tmp_path), arch=arch, seed=1, **overrides)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, kv_cache_blocks=12)
    (group,) = llm.runner.kv_layout.groups
    assert group.spec == spec and group.layer_indices == (0, 1)
