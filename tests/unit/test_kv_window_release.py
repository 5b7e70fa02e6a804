"""Sliding-window groups give back the blocks that left every query's window; prefix hits in such a group need only
the blocks still in the window; a group shared with a draft proposer keeps everything (pure Python, milliseconds)."""

from __future__ import annotations

from test_kv_groups import FULL, GroupCheckingRunner, make_scheduler, random_request, request, two_groups
from test_scheduler import run_to_completion

from kestrel.engine.kv_cache_manager import PLACEHOLDER_BLOCK_ID, KVCacheManager
from kestrel.kv_spec import KVCacheGroup, KVCacheLayout, SlidingWindowSpec

BS = 4  # WINDOW = 6: a query at position p reads p - 5 .. p


def decode(kv: KVCacheManager, req, steps: int) -> None:
    for _ in range(steps):
        req.num_computed_tokens = req.num_tokens
        req.append_output_token(1)
        assert kv.allocate(req, 1) is not None


def test_blocks_before_the_window_are_given_back() -> None:
    kv = KVCacheManager(two_groups(16, 16, release=True))
    a = request("a", list(range(20)))  # blocks 0..4
    full_ids, window_ids = kv.allocate(a, 20)
    assert [p.num_free_blocks for p in kv.pools] == [11, 11]
    decode(kv, a, 1)  # position 20 (a sixth block) reads 15..20: blocks 0..2 are out of every window
    assert [p.num_free_blocks for p in kv.pools] == [10, 13]
    full, window = kv.block_ids("a")
    assert full[:5] == full_ids and window[:5] == [PLACEHOLDER_BLOCK_ID] * 3 + window_ids[3:]
    decode(kv, a, 4)  # positions 21..24: 24 (a seventh block) reads 19..24, so block 3 (12..15) goes too
    assert [len(ids) for ids in kv.block_ids("a")] == [7, 7] and [p.num_free_blocks for p in kv.pools] == [9, 13]
    kv.free(a)
    assert [p.num_free_blocks for p in kv.pools] == [16, 16]


def test_the_given_back_blocks_stay_cached_until_reused() -> None:
    kv = KVCacheManager(two_groups(16, 16, release=True))
    a = request("a", list(range(20)))
    kv.allocate(a, 20)
    decode(kv, a, 1)
    window_pool = kv.pools[1]
    assert window_pool.num_cached_blocks == 5  # blocks 0..2 are free but still findable
    b = request("b", list(range(20)) + [7, 7, 7])
    hits, num_cached = kv.find_cached_prefix(b)
    assert num_cached == 20
    assert [x is None for x in hits[1]] == [True, True, True, False, False] and None not in hits[0]
    # Reusing the free blocks evicts the window group's blocks 0..2: b only needs 3 and 4 (positions 15..19).
    taken = window_pool.allocate(window_pool.num_free_blocks)
    assert window_pool.num_cached_blocks == 2
    hits, num_cached = kv.find_cached_prefix(b)
    assert num_cached == 20 and [x is None for x in hits[1]] == [True, True, True, False, False]
    window_pool.free(taken)
    held_before = window_pool.num_free_blocks
    full_ids, window_ids = kv.allocate(b, 3, hits)
    assert window_ids[:3] == [PLACEHOLDER_BLOCK_ID] * 3 and len(window_ids) == 6
    assert window_pool.num_free_blocks == held_before - 1  # only the fresh block for positions 20..22
    kv.free(a)
    kv.free(b)
    assert all(p.num_free_blocks == p.num_blocks for p in kv.pools)


def test_a_window_hit_needs_every_block_in_its_window() -> None:
    kv = KVCacheManager(two_groups(16, 16, release=True))
    a = request("a", list(range(20)))
    kv.allocate(a, 20)
    kv.free(a)
    window_pool = kv.pools[1]
    while window_pool.lookup(a.block_hashes[3]) is not None:  # evict block 3 (positions 12..15)
        window_pool.allocate(1)
    b = request("b", list(range(20)) + [9])
    # 20 tokens would need blocks 3 and 4; 16 need blocks 2 and 3; 12 need blocks 1 and 2.
    _, num_cached = kv.find_cached_prefix(b)
    assert num_cached == 12


def test_a_long_sequence_runs_in_a_window_group_smaller_than_it() -> None:
    """Three window blocks of 16 tokens hold a 100-token sequence: the window (6) never spans more than two."""
    layout = KVCacheLayout(16, (KVCacheGroup(FULL, (0,)), KVCacheGroup(SlidingWindowSpec(2, 8, window=6), (1,))),
                           (64, 3))
    sched = make_scheduler(layout, budget=16, max_seqs=2)
    sched.add_request(random_request("a", 80, max_tokens=20, seed=3))
    finished = run_to_completion(sched, GroupCheckingRunner(16))
    assert len(finished["a"].output_token_ids) == 20 and sched.stats.num_preemptions == 0
    assert all(p.num_free_blocks == p.num_blocks for p in sched.kv.pools)


def test_several_requests_with_prefix_hits_and_preemption_give_everything_back() -> None:
    layout = two_groups(40, 12, block_size=16, release=True)
    sched = make_scheduler(layout, budget=48, max_seqs=4, max_model_len=256)
    shared = list(range(100, 140))
    for i in range(8):
        extra = random_request(f"r{i}", 10 + 9 * i, max_tokens=12 + i, seed=i).prompt_token_ids
        sched.add_request(request(f"r{i}", (shared if i % 2 else []) + extra, max_tokens=12 + i))
    finished = run_to_completion(sched, GroupCheckingRunner(16))
    assert len(finished) == 8 and sched.kv.prefix_hits > 0
    assert all(p.num_free_blocks == p.num_blocks for p in sched.kv.pools)


def test_a_group_shared_with_a_drafter_keeps_every_block() -> None:
    kv = KVCacheManager(two_groups(16, 16, release=False))
    a = request("a", list(range(20)))
    kv.allocate(a, 20)
    decode(kv, a, 4)  # 24 tokens: six blocks in each group
    assert [p.num_free_blocks for p in kv.pools] == [10, 10]
