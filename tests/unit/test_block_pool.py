"""BlockPool and KVCacheManager rules: reference counts, prefix hits, eviction order."""

import pytest

from kestrel.engine.block_pool import BlockPool, hash_block
from kestrel.engine.kv_cache_manager import KVCacheManager
from kestrel.kv_spec import KVCacheLayout
from kestrel.request import Request
from kestrel.sampling_params import SamplingParams

BS = 4


def manager(num_blocks: int, enable_prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(KVCacheLayout.single_group(num_blocks, BS), enable_prefix_caching)


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_allocate_and_free_counts():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 2
    pool.touch(blocks[:1])
    assert blocks[0].ref_count == 2
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    pool.free(blocks[:1])
    assert pool.num_free_blocks == 5
    with pytest.raises(RuntimeError):
        pool.free(blocks[:1])
    with pytest.raises(RuntimeError):
        pool.allocate(6)


def test_chained_hash_depends_on_parent():
    a = hash_block(None, (1, 2, 3, 4))
    b = hash_block(hash_block(None, (9, 9, 9, 9)), (1, 2, 3, 4))
    assert a != b
    assert hash_block(None, (1, 2, 3, 4)) == a


def test_prefix_hit_reuses_blocks_and_leaves_one_token():
    kv = manager(10)
    first = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.find_cached_prefix(first) == ([[]], 0)
    (ids_a,) = kv.allocate(first, 10)
    assert len(ids_a) == 3
    second = make_request("b", list(range(8)) + [99, 98, 97])
    (hits,), num_cached = kv.find_cached_prefix(second)
    assert num_cached == 8 and [b.block_id for b in hits] == ids_a[:2]
    # A prompt fully covered by cached blocks still recomputes its last block.
    exact = make_request("c", list(range(8)))
    (hits,), num_cached = kv.find_cached_prefix(exact)
    assert num_cached == 4 and len(hits) == 1


def test_shared_blocks_survive_until_last_holder_frees():
    kv = manager(6)
    a = make_request("a", list(range(9)))
    kv.allocate(a, 9)
    b = make_request("b", list(range(9)))
    hits, num_cached = kv.find_cached_prefix(b)
    b.num_computed_tokens = 0
    kv.allocate(b, 9 - num_cached, hits)
    shared = kv.block_ids("a")[0][:2]
    assert kv.block_ids("b")[0][:2] == shared
    assert all(kv.pool.blocks[i].ref_count == 2 for i in shared)
    kv.free(a)
    assert all(kv.pool.blocks[i].ref_count == 1 for i in shared)
    kv.free(b)
    assert kv.pool.num_free_blocks == 6


def test_eviction_is_lru_and_tail_first():
    kv = manager(4)
    a = make_request("a", list(range(12)))  # three full blocks
    kv.allocate(a, 12)
    (ids,) = kv.block_ids("a")
    kv.free(a)
    # The free queue now holds the never-used block first, then a's blocks tail first.
    order = list(kv.pool._free)
    assert order[1:] == list(reversed(ids))
    # Taking two blocks evicts the never-used one and a's tail; a's head is still cached.
    kv.pool.allocate(2)
    c = make_request("c", list(range(12)) + [5])
    (hits,), num_cached = kv.find_cached_prefix(c)
    assert [b.block_id for b in hits] == ids[:2] and num_cached == 8


def test_allocate_refuses_when_full_and_leaves_no_trace():
    kv = manager(2)
    a = make_request("a", list(range(12)))
    assert kv.allocate(a, 12) is None
    assert kv.block_ids("a") == ([],) and kv.pool.num_free_blocks == 2


def test_no_caching_when_disabled():
    kv = manager(6, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    kv.allocate(a, 9)
    b = make_request("b", list(range(9)))
    assert kv.find_cached_prefix(b) == ([[]], 0)
    assert kv.pool.num_cached_blocks == 0
