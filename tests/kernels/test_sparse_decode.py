"""Quest (query-aware sparse decoding) kernels against float64 references: per-page key bounds kept as keys are
written, page selection, and decode attention over the selected pages, with pages of a whole block and of parts of
one. Triton runs interpreted on the CPU
(tests/kernels/conftest.py), compiled on a GPU; each Triton launcher is checked beside its torch reference."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels.attention import paged_attention_ref
from kestrel.kernels.sparse_decode import (
    AttentionConfig,
    StreamConfig,
    key_bounds_dtype,
    quest_block_scores,
    quest_block_scores_ref,
    quest_select,
    quest_select_ref,
    score_scale,
    select_pages,
    select_pages_triton,
    sparse_paged_decode,
    sparse_paged_decode_ref,
    stored_bound,
    update_key_bounds,
    update_key_bounds_ref,
)
from kestrel.kernels.store_kv import store_kv_ref

BLOCK = 16
FP8 = torch.float8_e4m3fn


def exact_bounds(k_cache: torch.Tensor, block: int, filled: int, page: int, k_scale: float = 1.0) -> torch.Tensor:
    """[pages, 2, H_kv, D] float32 min / max of each page's keys among the first `filled` of a block (+inf / -inf
    for a page with none), dequantized in float32 as the kernels do."""
    out = []
    for start in range(0, k_cache.shape[1], page):
        keys = k_cache[block, start: min(start + page, filled)].float() * k_scale
        if keys.shape[0] == 0:
            empty = torch.full(k_cache.shape[2:], float("inf"), device=k_cache.device)
            out.append(torch.stack([empty, -empty]))
        else:
            out.append(torch.stack([keys.amin(0), keys.amax(0)]))
    return torch.stack(out)


def bounds_oracle(k_cache: torch.Tensor, block: int, filled: int, page: int, k_scale: float = 1.0) -> torch.Tensor:
    """The stored bounds. bfloat16: the exact ones widened outward by 2^-6 of their magnitude in float32, then
    truncated (bit for bit what the kernels store). An FP8 cache's: the exact minima and maxima of its stored values
    (before k_scale), 0 for a page with no key."""
    if k_cache.dtype == FP8:
        exact = exact_bounds(k_cache, block, filled, page)
        return exact.masked_fill(torch.isinf(exact), 0.0).to(k_cache.dtype)
    exact = exact_bounds(k_cache, block, filled, page, k_scale)
    return torch.stack([stored_bound(exact[:, 0], -1.0), stored_bound(exact[:, 1], 1.0)], dim=1)


def update_both(k_cache, slots, bounds_triton, bounds_ref, k_scale=1.0) -> None:
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=k_cache.device)
    update_key_bounds(k_cache, slot_mapping, bounds_triton, k_scale)
    update_key_bounds_ref(k_cache, slot_mapping, bounds_ref, k_scale)


@pytest.mark.parametrize("cache_dtype, page", [(torch.float32, 16), (torch.bfloat16, 16), (FP8, 16),
                                               (torch.float32, 8), (FP8, 4)])
def test_key_bounds_follow_writes(device, cache_dtype, page) -> None:
    """Chunked prefill (full and partial blocks, two sequences in one step), decode appends, padded rows, a block
    freed and reused (its stale keys must not survive), and a prefix-cache block that is never rewritten."""
    torch.manual_seed(0)
    num_blocks, heads, dim = 8, 2, 24
    k_scale = 0.05 if cache_dtype == FP8 else 1.0
    k_cache = torch.zeros(num_blocks, BLOCK, heads, dim, dtype=cache_dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    bounds = torch.zeros(num_blocks, BLOCK // page, 2, heads, dim, dtype=key_bounds_dtype(cache_dtype),
                         device=device)
    bounds_ref = torch.zeros_like(bounds)

    def write(slots: list[int]) -> None:
        n = len(slots)
        key = torch.randn(n, heads, dim, device=device) * 3
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        store_kv_ref(key, torch.randn_like(key), k_cache, v_cache, slot_mapping, k_scale, 1.0)
        update_both(k_cache, slots, bounds, bounds_ref, k_scale)

    def check(block: int, filled: int) -> None:
        want = bounds_oracle(k_cache, block, filled, page, k_scale)
        torch.testing.assert_close(bounds[block].cpu().float(), want.cpu().float(), rtol=0, atol=0)
        torch.testing.assert_close(bounds_ref[block].cpu().float(), want.cpu().float(), rtol=0, atol=0)
        exact = exact_bounds(k_cache, block, filled, page, k_scale).cpu()
        finite = torch.isfinite(exact)
        if cache_dtype == FP8:  # in stored units, exact: k_scale times them is the dequantized keys' bounds
            assert torch.equal((bounds[block].cpu().float() * k_scale)[finite], exact[finite])
            return
        # stored in bfloat16, still bounds: below every key's minimum, above its maximum, within 2^-5 of them
        stored = bounds[block].cpu().float()
        assert (stored[:, 0] <= exact[:, 0]).all() and (stored[:, 1] >= exact[:, 1]).all()
        assert ((stored - exact).abs()[finite] <= exact.abs()[finite] * 2.0**-5 + 1e-30).all()

    # Step 1: sequence A prefills 20 tokens into blocks 3, 5; sequence B its first 7 into block 1; a padded row.
    write([3 * BLOCK + i for i in range(16)] + [5 * BLOCK + i for i in range(4)]
          + [BLOCK + i for i in range(7)] + [-1])
    check(3, 16), check(5, 4), check(1, 7)
    # Step 2: a chunk continues B's block 1 mid-block; A decodes one token.
    write([BLOCK + i for i in range(7, 12)] + [5 * BLOCK + 4])
    check(1, 12), check(5, 5)
    # Step 3: block 5 is freed and reused from offset 0 by another sequence: the old keys must not count.
    before = bounds[3].clone()
    write([5 * BLOCK, 5 * BLOCK + 1])
    check(5, 2)
    # Block 3 (a full block found in the prefix cache, read but not written) keeps its bounds.
    assert torch.equal(bounds[3], before)


def random_bounds_case(device, num_seqs=3, heads=8, kv_heads=2, dim=32, seq_lens=(150, 37, 1), width=12, page=BLOCK):
    g = torch.Generator().manual_seed(1)
    num_blocks = 48
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    bounds = torch.stack([bounds_oracle(k_cache, b, BLOCK, page) for b in range(num_blocks)])
    perm = torch.randperm(num_blocks, generator=g)[: num_seqs * width].view(num_seqs, width).to(torch.int32)
    q = torch.randn(num_seqs, heads, dim, generator=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return (q.to(device), k_cache.to(device), bounds.to(device), lens.to(device), perm.to(device))


@pytest.mark.parametrize("page, impl", [(16, "topk"), (8, "topk"), (4, "topk"), (16, "stream"), (4, "stream")])
def test_page_scores_bound_every_key_and_match_float64(device, page, impl) -> None:
    q, k_cache, bounds, seq_lens, tables = random_bounds_case(device, page=page)
    scale = 0.3
    scores = quest_block_scores(q, bounds, seq_lens, tables, scale, BLOCK, impl=impl).cpu().double()
    want = quest_block_scores_ref(q.double(), bounds, seq_lens, tables, scale, BLOCK).cpu()
    torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(quest_block_scores_ref(q, bounds, seq_lens, tables, scale, BLOCK).cpu().double(),
                               want, rtol=1e-5, atol=1e-4)
    # The score is an upper bound of every real scaled q.k in the page, for every head of the group.
    group = q.shape[1] // k_cache.shape[2]
    assert want.shape == (3, 2, tables.shape[1] * BLOCK // page)
    for s, seq_len in enumerate(seq_lens.tolist()):
        num_pages = -(-seq_len // page)
        for lp in range(num_pages):
            block, start = tables[s, lp * page // BLOCK].long(), lp * page % BLOCK
            keys = k_cache[block, start: start + page].cpu().double()  # [page, H_kv, D]
            for h in range(q.shape[1]):
                real = (keys[:, h // group] @ q[s, h].cpu().double()) * scale
                assert real.max() <= want[s, h // group, lp] + 1e-9
        assert torch.isinf(want[s, :, num_pages:]).all()


def selection_oracle(scores: torch.Tensor, seq_len: int, num_selected: int, sinks: int, recent: int,
                     page: int = BLOCK) -> list[int]:
    """Pages: `sinks` and `recent` counted in pages."""
    n = -(-seq_len // page)
    if n <= num_selected:
        return list(range(n))
    fixed = set(range(min(sinks, n))) | set(range(max(n - recent, 0), n))
    middle = sorted((i for i in range(n) if i not in fixed), key=lambda i: -float(scores[i]))
    return sorted(fixed | set(middle[: num_selected - sinks - recent]))


@pytest.mark.parametrize("num_selected, sinks, recent, page", [(6, 1, 2, 16), (4, 0, 1, 16), (12, 2, 2, 16),
                                                                (20, 1, 1, 16), (12, 1, 2, 8), (9, 0, 1, 4)])
def test_selection_matches_oracle(device, num_selected, sinks, recent, page) -> None:
    """`sinks` and `recent` are blocks; with pages of part of a block they keep every page of those blocks."""
    q, _, bounds, seq_lens, tables = random_bounds_case(device, seq_lens=(150, 37, 1), page=page)
    pages = BLOCK // page
    scores64 = quest_block_scores_ref(q.double(), bounds, seq_lens, tables, 0.2, BLOCK)
    chosen64 = select_pages(scores64, seq_lens, page, num_selected, sinks * pages, recent * pages).cpu()
    triton_chosen = quest_select(q, bounds, seq_lens, tables, 0.2, BLOCK, num_selected, sinks, recent).cpu()
    topk_chosen = quest_select(q, bounds, seq_lens, tables, 0.2, BLOCK, num_selected, sinks, recent,
                               impl="topk").cpu()
    ref_chosen = quest_select_ref(q, bounds, seq_lens, tables, 0.2, BLOCK, num_selected, sinks, recent).cpu()
    assert chosen64.shape == (3, 2, num_selected) and chosen64.dtype == torch.int32
    for s, seq_len in enumerate(seq_lens.tolist()):
        for h in range(2):
            want = selection_oracle(scores64[s, h].cpu(), seq_len, num_selected, sinks * pages, recent * pages,
                                    page)
            padded = want + [-1] * (num_selected - len(want))
            assert chosen64[s, h].tolist() == padded
            # fp32 scores may order near-ties differently: every chosen block must score within rounding of the
            # oracle's worst chosen one.
            for got in (triton_chosen[s, h], topk_chosen[s, h], ref_chosen[s, h]):
                picked = [b for b in got.tolist() if b >= 0]
                assert len(picked) == len(want) and sorted(picked) == picked
                worst = min(float(scores64[s, h, b]) for b in want)
                assert all(b in want or float(scores64[s, h, b]) >= worst - 1e-4 for b in picked)


def tied_scores(num_seqs: int, kv_heads: int, width: int, seed: int) -> torch.Tensor:
    """Scores with many exact ties (a few values only), signed zeros, -inf (never chosen) and +inf."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (num_seqs, kv_heads, width), generator=g).float() * 0.75
    scores[0, 0, : width // 4] = -0.0
    scores[0, -1, ::7] = float("-inf")
    scores[-1, 0, ::11] = float("inf")
    return scores


@pytest.mark.parametrize("num_selected, sinks, recent, page, chunk", [(40, 2, 4, 8, 64), (12, 0, 1, 16, 32),
                                                                      (300, 1, 1, 4, 64), (9, 2, 6, 8, 128),
                                                                      (40, 2, 4, 8, 512), (9, 0, 1, 16, 512)])
def test_triton_selection_equals_reference(device, num_selected, sinks, recent, page, chunk) -> None:
    """From the same scores the Triton selection is the reference's, tie for tie (ties: the lower page), for
    continuous scores, heavy ties, +-inf, and sequences of a full table, a partial page, one token, none; rows
    read in chunks and (chunk 512) once into registers."""
    width = 300
    lens = torch.tensor([width * page, 37 * page - 3, 1, 0], dtype=torch.int32, device=device)
    config = StreamConfig(select_chunk=chunk)
    for scores in (tied_scores(4, 2, width, 0), torch.randn(4, 2, width, generator=torch.Generator().manual_seed(3)),
                   -torch.rand(4, 2, width, generator=torch.Generator().manual_seed(4)) * 1e-30):
        scores = scores.to(device)
        got = select_pages_triton(scores, lens, page, num_selected, sinks, recent, config=config)
        want = select_pages(scores, lens, page, num_selected, sinks, recent)
        assert torch.equal(got.cpu(), want.cpu())


def exact_bounds_case(device, page: int, seq_lens=(300, 123, 16, 0), kv_heads=2, heads=8, dim=16, width=24,
                      bounds_dtype=torch.bfloat16):
    """Integer queries and bounds: every product and sum is exact in fp32 whatever the order, so the Triton scores
    are the reference's bit for bit, and the few distinct values make many ties."""
    g = torch.Generator().manual_seed(5)
    num_blocks = len(seq_lens) * width
    lowest = torch.randint(-4, 4, (num_blocks, BLOCK // page, kv_heads, dim), generator=g).float()
    highest = lowest + torch.randint(0, 3, lowest.shape, generator=g).float()
    bounds = torch.stack([lowest, highest], dim=2).to(bounds_dtype)
    q = torch.randint(-2, 3, (len(seq_lens), heads, dim), generator=g).float()
    tables = torch.randperm(num_blocks, generator=g).view(len(seq_lens), width).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q.to(device), bounds.to(device), lens.to(device), tables.to(device)


@pytest.mark.parametrize("page, num_selected, sinks, recent, bounds_dtype", [
    (16, 8, 1, 2, torch.bfloat16), (8, 20, 1, 1, torch.bfloat16), (4, 33, 0, 1, torch.bfloat16),
    (16, 8, 1, 2, FP8), (4, 33, 0, 1, FP8)])
def test_stream_selection_equals_reference_exactly(device, page, num_selected, sinks, recent, bounds_dtype) -> None:
    """bfloat16 bounds and an FP8 cache's (read as stored values)."""
    q, bounds, lens, tables = exact_bounds_case(device, page, bounds_dtype=bounds_dtype)
    got = quest_select(q, bounds, lens, tables, 0.25, BLOCK, num_selected, sinks, recent, impl="stream")
    want = quest_select_ref(q, bounds, lens, tables, 0.25, BLOCK, num_selected, sinks, recent)
    assert torch.equal(got.cpu(), want.cpu())
    scores = quest_block_scores(q, bounds, lens, tables, 0.25, BLOCK, impl="stream")
    torch.testing.assert_close(scores.cpu(), quest_block_scores_ref(q, bounds, lens, tables, 0.25, BLOCK).cpu(),
                               rtol=0, atol=0)


def sparse_oracle(q, k_cache, v_cache, seq_lens, tables, selected, scale, k_scale=1.0, v_scale=1.0, page=BLOCK):
    """float64 dense attention of each decode token over all its context, with unselected pages masked."""
    num_seqs, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    out = torch.zeros(num_seqs, heads, dim, dtype=torch.float64)
    for s, seq_len in enumerate(seq_lens.tolist()):
        n = -(-seq_len // BLOCK)
        blocks = tables[s, :n].long().cpu()
        keys = k_cache.cpu()[blocks].reshape(-1, kv_heads, dim)[:seq_len].double() * k_scale
        vals = v_cache.cpu()[blocks].reshape(-1, kv_heads, dim)[:seq_len].double() * v_scale
        for h in range(heads):
            keep = torch.zeros(seq_len, dtype=torch.bool)
            for lp in selected[s, h // group].tolist():
                if lp >= 0:
                    keep[lp * page: (lp + 1) * page] = True
            if not keep.any():
                continue
            scores = (keys[:, h // group] @ q[s, h].cpu().double()) * scale
            probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), 0)
            out[s, h] = probs @ vals[:, h // group]
    return out


def sparse_case(device, heads, kv_heads, dim, seq_lens, cache_dtype=torch.float32, q_dtype=torch.float32,
                num_selected=5, page=BLOCK):
    g = torch.Generator().manual_seed(2)
    num_blocks = 64
    width = max(-(-s // BLOCK) for s in seq_lens) + 2
    k = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    v = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    k_scale = v_scale = 1.0
    if cache_dtype == FP8:
        k_scale, v_scale = 0.01, 0.02
        k, v = (k / k_scale).to(FP8), (v / v_scale).to(FP8)
    else:
        k, v = k.to(cache_dtype), v.to(cache_dtype)
    tables = torch.randperm(num_blocks - 4, generator=g)[: len(seq_lens) * width].view(len(seq_lens), width)
    tables = tables.to(torch.int32)
    # Slots past a sequence's end and the blocks its table is padded with hold NaN: no stray read may reach the
    # output.
    for s, seq_len in enumerate(seq_lens):
        n = -(-seq_len // BLOCK)
        k[tables[s, n - 1].long(), seq_len - (n - 1) * BLOCK:] = float("nan")
        v[tables[s, n - 1].long(), seq_len - (n - 1) * BLOCK:] = float("nan")
        tables[s, n:] = num_blocks - 1 - torch.arange(width - n, dtype=torch.int32) % 4
    k[num_blocks - 4:] = float("nan")
    v[num_blocks - 4:] = float("nan")
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), heads, dim, generator=g).to(q_dtype)
    selected = torch.full((len(seq_lens), kv_heads, num_selected), -1, dtype=torch.int32)
    for s, seq_len in enumerate(seq_lens):
        n = -(-seq_len // page)
        for h in range(kv_heads):
            # The last (partial) page is always chosen, as the recent ones are, so the length mask is exercised;
            # odd heads leave a slot unused.
            pick = sorted(torch.randperm(n - 1, generator=g)[: num_selected - 1 - (h % 2)].tolist()) + [n - 1]
            selected[s, h, : len(pick)] = torch.tensor(pick, dtype=torch.int32)
    to = {"device": device}
    return (q.to(**to), k.to(**to), v.to(**to), lens.to(**to), tables.to(**to), selected.to(**to), k_scale, v_scale)


@pytest.mark.parametrize("heads, kv_heads, dim, page", [(4, 4, 32, 16), (8, 2, 64, 16), (8, 1, 24, 16),
                                                         (8, 2, 64, 8), (4, 1, 24, 4)])
@pytest.mark.parametrize("splits", [1, 3])
def test_sparse_attention_matches_masked_oracle(device, heads, kv_heads, dim, page, splits) -> None:
    """Pages of part of a block: a key tile gathers several selected pages (an odd count leaves one empty)."""
    num_selected = 5 if page == BLOCK else 9
    q, k, v, lens, tables, selected, ks, vs = sparse_case(device, heads, kv_heads, dim, (150, 37, 9, 70),
                                                          num_selected=num_selected, page=page)
    want = sparse_oracle(q, k, v, lens, tables, selected, 0.25, page=page)
    got = sparse_paged_decode(q, k, v, lens, tables, selected, 0.25, page_size=page,
                              num_splits=splits).cpu().double()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ref = sparse_paged_decode_ref(q, k, v, lens, tables, selected, 0.25, page_size=page).cpu().double()
    torch.testing.assert_close(ref, want, rtol=1e-4, atol=1e-4)


def test_split_merges_agree(device) -> None:
    """The Triton merge of split partials is the torch one's."""
    q, k, v, lens, tables, selected, _, _ = sparse_case(device, 8, 2, 32, (150, 37, 9), num_selected=5)
    fused = sparse_paged_decode(q, k, v, lens, tables, selected, 0.25, num_splits=3, merge="triton")
    chained = sparse_paged_decode(q, k, v, lens, tables, selected, 0.25, num_splits=3, merge="torch")
    torch.testing.assert_close(fused.cpu(), chained.cpu(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cache_dtype, q_dtype, page", [(FP8, torch.float32, 16), (torch.bfloat16, torch.bfloat16, 16),
                                                        (FP8, torch.float32, 8)])
def test_sparse_attention_fp8_and_bf16_caches(device, cache_dtype, q_dtype, page) -> None:
    q, k, v, lens, tables, selected, ks, vs = sparse_case(device, 8, 2, 32, (100, 33), cache_dtype, q_dtype,
                                                          num_selected=5 * BLOCK // page, page=page)
    want = sparse_oracle(q, k, v, lens, tables, selected, 0.2, ks, vs, page=page)
    tol = 2e-2 if q_dtype == torch.bfloat16 else 1e-4
    for splits in (1, 2):
        got = sparse_paged_decode(q, k, v, lens, tables, selected, 0.2, ks, vs, page_size=page, num_splits=splits)
        torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)
    ref = sparse_paged_decode_ref(q, k, v, lens, tables, selected, 0.2, ks, vs, page_size=page)
    torch.testing.assert_close(ref.cpu().double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("page", [16, 8])
def test_selection_of_every_page_equals_dense_attention(device, page) -> None:
    """A context within the budget selects every page: the sparse output is the dense one."""
    seq_lens = (70, 16, 3)
    q, k, v, lens, tables, _, _, _ = sparse_case(device, 8, 2, 32, seq_lens)
    pages = BLOCK // page
    bounds = torch.zeros(k.shape[0], pages, 2, 2, 32, dtype=key_bounds_dtype(k.dtype), device=device)
    slots = torch.cat([tables[s, torch.arange(n, device=device) // BLOCK].long() * BLOCK
                       + torch.arange(n, device=device) % BLOCK for s, n in enumerate(seq_lens)])
    update_key_bounds(k, slots, bounds)
    selected = quest_select(q, bounds, lens, tables, 0.2, BLOCK, 6 * pages, 1, 2)
    n_pages = [-(-n // page) for n in seq_lens]
    for s, n in enumerate(n_pages):
        assert selected[s, :, :n].tolist() == [list(range(n))] * 2 and (selected[s, :, n:] == -1).all()
    query_start = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device)
    dense = paged_attention_ref(q.double(), k, v, query_start, lens, tables, 0.2)
    got = sparse_paged_decode(q, k, v, lens, tables, selected, 0.2, page_size=page).double()
    torch.testing.assert_close(got.cpu(), dense.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page", [16, 4])
def test_fp8_cache_selection_bounds_every_dequantized_key(device, page) -> None:
    """An FP8 cache: bounds kept as stored values, scores scaled by k_scale (score_scale) bound every real scaled
    q.k of their page, in the Triton paths and the reference alike, and select the reference's pages."""
    g = torch.Generator().manual_seed(7)
    num_blocks, kv_heads, heads, dim, k_scale = 20, 2, 8, 32, 0.02
    k_cache = (torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g) / k_scale).to(FP8).to(device)
    tables = torch.randperm(num_blocks, generator=g)[:18].view(2, 9).to(torch.int32).to(device)
    lens = torch.tensor([140, 57], dtype=torch.int32, device=device)
    q = torch.randn(2, heads, dim, generator=g).to(device)
    bounds = torch.zeros(num_blocks, BLOCK // page, 2, kv_heads, dim, dtype=FP8, device=device)
    update_key_bounds(k_cache, torch.arange(num_blocks * BLOCK, device=device), bounds, k_scale)
    scale = dim ** -0.5
    bound_scale = score_scale(bounds, scale, k_scale)
    assert bound_scale == scale * k_scale
    want = quest_block_scores_ref(q.double(), bounds, lens, tables, bound_scale, BLOCK).cpu()
    for impl in ("stream", "topk"):
        got = quest_block_scores(q, bounds, lens, tables, bound_scale, BLOCK, impl=impl).cpu().double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    keys = k_cache.cpu().double() * k_scale
    for s, seq_len in enumerate(lens.tolist()):
        for lp in range(-(-seq_len // page)):
            block, start = tables[s, lp * page // BLOCK].long().cpu(), lp * page % BLOCK
            page_keys = keys[block, start: min(start + page, start + seq_len - lp * page)]
            for h in range(heads):
                real = page_keys[:, h // (heads // kv_heads)] @ q[s, h].cpu().double() * scale
                assert real.max() <= want[s, h // (heads // kv_heads), lp] + 1e-9
    got = quest_select(q, bounds, lens, tables, bound_scale, BLOCK, 24 // page * 4, 1, 1)
    ref = quest_select_ref(q, bounds, lens, tables, bound_scale, BLOCK, 24 // page * 4, 1, 1)
    assert torch.equal(got.cpu(), ref.cpu())


@pytest.mark.parametrize("config", [AttentionConfig(keys_per_tile=32), AttentionConfig(num_stages=2, num_warps=8),
                                    AttentionConfig(keys_per_tile=64, num_stages=3, programs_per_sm=8)])
@pytest.mark.parametrize("page", [16, 8])
def test_sparse_attention_launch_shapes_match_the_oracle(device, config, page) -> None:
    """Wider key tiles (several pages a step, an odd selection leaving part of the last tile empty), deeper
    pipelines and more splits compute the same attention."""
    q, k, v, lens, tables, selected, _, _ = sparse_case(device, 8, 2, 32, (150, 37, 9, 70), num_selected=7,
                                                        page=page)
    want = sparse_oracle(q, k, v, lens, tables, selected, 0.25, page=page)
    got = sparse_paged_decode(q, k, v, lens, tables, selected, 0.25, page_size=page, config=config)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-4)
