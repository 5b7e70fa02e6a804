"""KV-cache specs and groups: grouping rules, the layout's checks, and the engine's per-group block lists
(allocation, prefix hits, preemption, lookahead, freeing) with a fake runner, in milliseconds."""

from __future__ import annotations

import random

import pytest
from test_scheduler import FakeRunner, run_to_completion

from kestrel.config import CacheConfig, ConfigError, SchedulerConfig
from kestrel.engine.contracts import run_step
from kestrel.engine.kv_cache_manager import NO_NEW_BLOCKS, KVCacheManager
from kestrel.engine.scheduler import Scheduler
from kestrel.kv_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheLayout,
    LatentAttentionSpec,
    NoKVCacheSpec,
    SlidingWindowSpec,
    as_layout,
    group_layers,
    layer_group_indices,
)
from kestrel.request import Request
from kestrel.sampling_params import SamplingParams

BS = 4
FULL = FullAttentionSpec(num_kv_heads=2, head_size=8)
WINDOW = SlidingWindowSpec(num_kv_heads=2, head_size=8, window=6)


def two_groups(full_blocks: int = 32, window_blocks: int = 32, block_size: int = BS,
               release: bool = False) -> KVCacheLayout:
    """A full-attention group and a window group, which keeps every block unless `release`."""
    groups = (KVCacheGroup(FULL, (0, 2)), KVCacheGroup(WINDOW, (1, 3)))
    return KVCacheLayout(block_size, groups, (full_blocks, window_blocks),
                         keep_all_blocks=frozenset() if release else frozenset({1}))


def request(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens))


# ----- specs and groups ----------------------------------------------------------------------------------------


def test_groups_follow_first_appearance_and_skip_layers_without_cache() -> None:
    specs = [WINDOW, FULL, WINDOW, NoKVCacheSpec(), FULL, LatentAttentionSpec(width=64)]
    groups = group_layers(specs)
    assert [g.spec for g in groups] == [WINDOW, FULL, LatentAttentionSpec(width=64)]
    assert [g.layer_indices for g in groups] == [(0, 2), (1, 4), (5,)]
    assert layer_group_indices(groups, len(specs)) == [0, 1, 0, None, 1, 2]
    assert group_layers([FULL] * 5) == (KVCacheGroup(FULL, (0, 1, 2, 3, 4)),)


def test_a_window_is_its_own_spec() -> None:
    assert WINDOW != FULL and SlidingWindowSpec(2, 8, window=7) != WINDOW
    assert len(group_layers([FULL, WINDOW, SlidingWindowSpec(2, 8, window=7)])) == 3
    with pytest.raises(ValueError, match="window"):
        SlidingWindowSpec(2, 8, window=0)
    with pytest.raises(ValueError, match="head_size"):
        FullAttentionSpec(2, 0)


def test_bytes_take_the_element_size() -> None:
    assert FULL.bytes_per_token(2) == 2 * 2 * 8 * 2
    assert WINDOW.bytes_per_block(16, 1) == 16 * 2 * 2 * 8
    assert LatentAttentionSpec(width=576).bytes_per_token(2) == 1152
    assert CrossAttentionSpec(2, 8, max_encoder_len=10).bytes_per_block(4, 4) == 4 * 2 * 2 * 8 * 4
    assert NoKVCacheSpec().bytes_per_block(16, 2) == 0
    assert KVCacheGroup(FULL, (0, 1, 2)).bytes_per_block(16, 2) == 3 * FULL.bytes_per_block(16, 2)


def test_layout_checks_every_group_holds_a_sequence() -> None:
    two_groups(16, 16).check_holds(64)
    with pytest.raises(ConfigError, match="invalid kv_cache_blocks=15.*max_model_len=64"):
        two_groups(16, 15).check_holds(64)
    cross = KVCacheLayout(BS, (KVCacheGroup(FULL, (0,)), KVCacheGroup(CrossAttentionSpec(2, 8, 20), (1,))), (16, 4))
    with pytest.raises(ConfigError, match="cross-attention group needs 5 blocks"):
        cross.check_holds(64)
    assert as_layout(7, BS) == KVCacheLayout.single_group(7, BS)
    with pytest.raises(ConfigError, match="block_size"):
        as_layout(two_groups(), 16)
    with pytest.raises(ValueError, match="2 block counts for 1 groups"):
        KVCacheLayout(BS, (KVCacheGroup(FULL, (0,)),), (4, 4))


# ----- the manager ---------------------------------------------------------------------------------------------


def test_allocation_gives_each_group_its_own_blocks() -> None:
    kv = KVCacheManager(two_groups(10, 6))
    a = request("a", list(range(9)))
    full_ids, window_ids = kv.allocate(a, 9)
    assert len(full_ids) == len(window_ids) == 3
    assert kv.block_ids("a") == (full_ids, window_ids)
    assert [p.num_free_blocks for p in kv.pools] == [7, 3]
    a.num_computed_tokens = 9
    a.append_output_token(1)
    assert kv.allocate(a, 1) is NO_NEW_BLOCKS  # the last block of every group has room
    a.num_computed_tokens = 10
    a.append_output_token(2)
    a.append_output_token(3)
    added = kv.allocate(a, 3)  # positions 10..12: one more block in each group
    assert [len(ids) for ids in added] == [1, 1]
    kv.free(a)
    assert [p.num_free_blocks for p in kv.pools] == [10, 6]


def test_allocation_fails_when_any_group_is_full_and_leaves_no_trace() -> None:
    kv = KVCacheManager(two_groups(10, 2))
    a = request("a", list(range(12)))
    assert kv.allocate(a, 12) is None
    assert kv.block_ids("a") == ([], []) and [p.num_free_blocks for p in kv.pools] == [10, 2]
    assert kv.allocate(a, 8) is not None


def test_prefix_hit_counts_only_blocks_every_group_has() -> None:
    kv = KVCacheManager(two_groups(10, 10))
    a = request("a", list(range(13)))  # three full blocks + one token
    kv.allocate(a, 13)
    assert [p.num_cached_blocks for p in kv.pools] == [3, 3]
    b = request("b", list(range(12)) + [99])
    hits, num_cached = kv.find_cached_prefix(b)
    assert num_cached == 12 and [[x.block_id for x in h] for h in hits] == [ids[:3] for ids in kv.block_ids("a")]
    kv.free(a)
    # The window group's third block is evicted (its pool hands it out again); the full group still has it.
    window_pool = kv.pools[1]
    while window_pool.lookup(a.block_hashes[2]) is not None:
        window_pool.allocate(1)
    hits, num_cached = kv.find_cached_prefix(b)
    assert num_cached == 8 and [len(h) for h in hits] == [2, 2]


def test_cross_attention_blocks_are_taken_once_and_never_published() -> None:
    cross = CrossAttentionSpec(2, 8, max_encoder_len=10)  # 3 blocks per request
    layout = KVCacheLayout(BS, (KVCacheGroup(FULL, (0,)), KVCacheGroup(cross, (1,))), (10, 6))
    kv = KVCacheManager(layout)
    a = request("a", list(range(6)))
    full_ids, cross_ids = kv.allocate(a, 6)
    assert len(full_ids) == 2 and len(cross_ids) == 3
    a.num_computed_tokens = 6
    for t in range(3):
        a.append_output_token(t)
    assert [len(ids) for ids in kv.allocate(a, 3)] == [1, 0]
    assert kv.pools[1].num_cached_blocks == 0
    b = request("b", list(range(6)))
    hits, num_cached = kv.find_cached_prefix(b)
    assert num_cached == 4 and [len(h) for h in hits] == [1, 0]
    assert kv.allocate(b, 2, hits) is not None
    c = request("c", list(range(50, 54)))
    assert kv.allocate(c, 4) is None  # the cross group has no 3 blocks left
    kv.free(a)
    kv.free(b)
    assert [p.num_free_blocks for p in kv.pools] == [10, 6]


# ----- the scheduler over two groups ---------------------------------------------------------------------------


class GroupCheckingRunner(FakeRunner):
    """FakeRunner's checks (every group covers the scheduled tokens), plus: the groups hold as many blocks as each
    other (they grow in lockstep)."""

    def _run(self, out):
        result = super()._run(out)
        for rid in out.num_scheduled_tokens:
            blocks = self.state[rid]["blocks"]
            assert len(blocks) == 2 and len(blocks[0]) == len(blocks[1])
        return result


def make_scheduler(layout: KVCacheLayout, budget: int = 64, max_seqs: int = 8, max_model_len: int = 512,
                   caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
                     CacheConfig(block_size=layout.block_size, enable_prefix_caching=caching), layout, max_model_len)


def random_request(rid: str, n_prompt: int, max_tokens: int, seed: int) -> Request:
    rng = random.Random(seed)
    return request(rid, [rng.randrange(500) for _ in range(n_prompt)], max_tokens)


@pytest.mark.parametrize("release", [False, True])
def test_everything_finishes_and_every_group_is_freed(release: bool) -> None:
    layout = two_groups(64, 64, block_size=16, release=release)
    sched = make_scheduler(layout, budget=32, max_seqs=4)
    for i in range(12):
        sched.add_request(random_request(f"r{i}", 5 + 7 * i, max_tokens=3 + i % 5, seed=i))
    finished = run_to_completion(sched, GroupCheckingRunner(16))
    assert len(finished) == 12
    assert all(p.num_free_blocks == p.num_blocks for p in sched.kv.pools)


def test_the_tighter_group_preempts() -> None:
    """The window group has 6 blocks (and keeps them all), the full one plenty: two 40-token sequences fit the full
    group but not the window group, so one is preempted, recomputed and still finishes."""
    layout = two_groups(64, 6, block_size=16)
    sched = make_scheduler(layout, budget=128, max_seqs=4, max_model_len=96)
    sched.add_request(random_request("a", 40, max_tokens=20, seed=1))
    sched.add_request(random_request("b", 40, max_tokens=20, seed=2))
    finished = run_to_completion(sched, GroupCheckingRunner(16))
    assert set(finished) == {"a", "b"} and all(len(r.output_token_ids) == 20 for r in finished.values())
    assert sched.stats.num_preemptions >= 1
    assert all(p.num_free_blocks == p.num_blocks for p in sched.kv.pools)


def test_prefix_hits_across_groups_in_the_scheduler() -> None:
    layout = two_groups(64, 64, block_size=16)
    sched = make_scheduler(layout)
    runner = GroupCheckingRunner(16)
    prompt = list(range(40))
    sched.add_request(request("a", prompt, max_tokens=2))
    run_to_completion(sched, runner)
    sched.add_request(request("b", prompt + [7], max_tokens=2))
    out = sched.schedule()
    (new,) = out.new_requests
    assert new.num_computed_tokens == 32 and out.num_scheduled_tokens == {"b": 9}
    assert len(new.block_ids) == 2 and all(len(ids) == 3 for ids in new.block_ids)
    assert sched.kv.prefix_hits == 32


def test_prefix_cache_counters_count_each_admitted_request_once() -> None:
    """vLLM's prefix-cache queries and hits: one lookup per request, counted at its admission; a preempted
    request's readmission (its own blocks found again) is left out."""
    layout = two_groups(64, 64, block_size=16)
    sched = make_scheduler(layout)
    prompt = list(range(40))
    sched.add_request(request("a", prompt, max_tokens=2))
    run_to_completion(sched, GroupCheckingRunner(16))
    assert (sched.kv.prefix_queries, sched.kv.prefix_hits) == (40, 0)
    readmitted = request("b", prompt + [7], max_tokens=2)
    readmitted.num_preemptions = 1
    sched.add_request(readmitted)
    run_to_completion(sched, GroupCheckingRunner(16))
    assert (sched.kv.prefix_queries, sched.kv.prefix_hits) == (40, 0)
    sched.add_request(request("c", prompt + [8], max_tokens=2))
    run_to_completion(sched, GroupCheckingRunner(16))
    assert (sched.kv.prefix_queries, sched.kv.prefix_hits) == (81, 32)


def test_lookahead_covers_every_group_and_is_dropped_when_tight() -> None:
    sched = make_scheduler(two_groups(64, 64, block_size=16))
    sched.add_request(request("a", list(range(28)), max_tokens=10))
    out = sched.schedule(draft_lookahead=5)  # 28 tokens + 5 lookahead positions: 3 blocks per group
    assert out.draft_request_ids == {"a"} and [len(ids) for ids in out.new_requests[0].block_ids] == [3, 3]
    tight = make_scheduler(two_groups(64, 2, block_size=16))
    tight.add_request(request("a", list(range(28)), max_tokens=10))
    out = tight.schedule(draft_lookahead=5)  # the window group has only 2 blocks: no lookahead, no preemption
    assert out.draft_request_ids == frozenset() and out.num_scheduled_tokens == {"a": 28}
    assert [len(ids) for ids in out.new_requests[0].block_ids] == [2, 2]


def test_cached_requests_carry_new_blocks_per_group() -> None:
    sched = make_scheduler(two_groups(64, 64, block_size=16), budget=16)
    runner = GroupCheckingRunner(16)
    sched.add_request(request("a", list(range(40)), max_tokens=3))
    out = sched.schedule()
    first = out.new_requests[0].block_ids
    assert [len(ids) for ids in first] == [1, 1]
    sched.update(out, run_step(runner, out))
    out = sched.schedule()
    (cached,) = out.cached_requests
    assert [len(ids) for ids in cached.new_block_ids] == [1, 1]
    assert sched.kv.block_ids("a") == tuple(a + b for a, b in zip(first, cached.new_block_ids))
