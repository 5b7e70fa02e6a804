"""The KV manager's `quiet_until`, which the scheduler's decode loop reads instead of calling `allocate`: wherever
it says a request's next tokens need nothing, `allocate` must return NO_NEW_BLOCKS and change nothing, with and
without prefix caching, with tokens known late (async scheduling) and with windows that give blocks back."""

from __future__ import annotations

import random

import pytest
from test_kv_groups import BS, FULL, two_groups

from kestrel.engine.kv_cache_manager import NO_NEW_BLOCKS, KVCacheManager
from kestrel.kv_spec import KVCacheGroup, KVCacheLayout
from kestrel.request import Request
from kestrel.sampling_params import SamplingParams


def _state(kv: KVCacheManager) -> tuple:
    return ([pool.num_free_blocks for pool in kv.pools], dict(kv._num_published),
            {rid: [list(g) for g in held] for rid, held in kv._blocks.items()},
            [pool.num_cached_blocks for pool in kv.pools])


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("layout", ["one group", "two groups"])
def test_quiet_requests_need_nothing_from_allocate(prefix_caching: bool, layout: str) -> None:
    rng = random.Random(7)
    kv_layout = (KVCacheLayout(BS, (KVCacheGroup(FULL, (0, 1)),), (256,)) if layout == "one group"
                 else two_groups(256, 256))
    kv = KVCacheManager(kv_layout, enable_prefix_caching=prefix_caching)
    shared = [rng.randrange(100) for _ in range(2 * BS)]
    requests = [Request(f"r{i}", shared + [rng.randrange(100) for _ in range(rng.randrange(1, 3 * BS))],
                        SamplingParams(max_tokens=64)) for i in range(6)]
    late: dict[str, int] = {}  # a token sampled but not yet known to the host (async scheduling)
    quiet_checked = 0
    for request in requests:
        prefix, num_cached = kv.find_cached_prefix(request)
        assert kv.allocate(request, request.num_tokens - num_cached, prefix) is not None
        request.num_computed_tokens = request.num_tokens
        request.append_output_token(rng.randrange(100))  # the prompt's step samples the first token
    for _ in range(40):
        for request in requests:
            rid = request.request_id
            # Each step computes the request's last token: known, or (async) sampled by the step before and
            # known only once that step is collected, after this one is scheduled.
            quiet = request.num_computed_tokens + 1 <= kv.quiet_until.get(rid, -1)
            before = _state(kv)
            assert kv.allocate(request, 1) is not None
            if quiet:
                quiet_checked += 1
                assert _state(kv) == before, f"{rid} was quiet at {request.num_computed_tokens + 1} tokens"
            request.num_computed_tokens += 1
            if rid in late:
                request.append_output_token(late.pop(rid))
            token = rng.randrange(100)
            if rng.random() < 0.5:
                late[rid] = token
            else:
                request.append_output_token(token)
    assert quiet_checked > 100  # most decode steps are quiet
    for request in requests:
        kv.free(request)
    assert not kv.quiet_until


def test_windows_that_give_blocks_back_are_never_quiet() -> None:
    kv = KVCacheManager(two_groups(64, 64, release=True))
    request = Request("r", list(range(3 * BS)), SamplingParams(max_tokens=32))
    assert kv.allocate(request, request.num_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    for token in range(2 * BS):
        assert kv.allocate(request, 1) is not None
        request.num_computed_tokens += 1
        request.append_output_token(token)
    assert kv.quiet_until == {}


def test_a_request_past_its_quiet_count_gets_its_block() -> None:
    kv = KVCacheManager(KVCacheLayout(BS, (KVCacheGroup(FULL, (0,)),), (16,)), enable_prefix_caching=False)
    request = Request("r", list(range(BS - 1)), SamplingParams(max_tokens=8))
    assert kv.allocate(request, request.num_tokens) == ([0],)
    request.num_computed_tokens = request.num_tokens
    assert kv.quiet_until["r"] == BS  # one block: room up to its 4th token
    assert kv.allocate(request, 1) is NO_NEW_BLOCKS
    request.num_computed_tokens += 1
    assert kv.allocate(request, 1) not in (None, NO_NEW_BLOCKS)  # the 5th token opens a block
    assert kv.quiet_until["r"] == 2 * BS
