"""GPU-only: Quest's "stream" selection (streamed page scores on tensor cores, Triton radix top-k) and the Triton
merge of split partials, compiled at the 8B shape (32 / 8 heads of 128, BF16 and FP8 caches), against the references
and the earlier "topk" path, and captured in a CUDA graph (skipped on CPU). Run on the H200:
`.venv/bin/python -m pytest -q tests/gpu/test_quest_select_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels.sparse_decode import (
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
    update_key_bounds,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK = 16
HEADS, KV_HEADS, DIM = 32, 8, 128


FP8 = torch.float8_e4m3fn
K_SCALE = 1 / 32  # an FP8 cache's: its stored keys are 32x the real ones


def case(batch: int, context: int, page: int, seed: int = 0, cache_dtype: torch.dtype = torch.bfloat16):
    """Random K/V of `batch` sequences (the first one shorter: a partial page), shuffled blocks, bounds kept by
    update_key_bounds as the engine keeps them. An FP8 cache stores keys / K_SCALE (V unscaled)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq + 3
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, device="cuda", generator=g)
    k = (k / K_SCALE if cache_dtype == FP8 else k).to(cache_dtype)
    v = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, device="cuda", generator=g).to(cache_dtype)
    q = torch.randn(batch, HEADS, DIM, device="cuda", generator=g, dtype=torch.bfloat16)
    tables = torch.randperm(num_blocks, device="cuda", generator=g)[: batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    lens[0] = context - 5 * page // 2
    bounds = torch.zeros(num_blocks, BLOCK // page, 2, KV_HEADS, DIM, dtype=key_bounds_dtype(cache_dtype),
                         device="cuda")
    update_key_bounds(k, torch.arange(num_blocks * BLOCK, device="cuda"), bounds, K_SCALE)
    return q, k, v, lens, tables, bounds


@pytest.mark.parametrize("page", [16, 8])
@pytest.mark.parametrize("config", [StreamConfig(), StreamConfig(block_b=64, num_stages=2, programs_per_sm=4)])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_stream_scores_and_selection(page: int, config: StreamConfig, cache_dtype: torch.dtype) -> None:
    q, k, v, lens, tables, bounds = case(8, 4096, page, cache_dtype=cache_dtype)
    scale = score_scale(bounds, DIM ** -0.5, K_SCALE)
    scores = quest_block_scores(q, bounds, lens, tables, scale, BLOCK, config=config)
    want = quest_block_scores_ref(q.double(), bounds, lens, tables, scale, BLOCK)
    torch.testing.assert_close(scores.double(), want, rtol=1e-5, atol=1e-4)
    legacy = quest_block_scores(q, bounds, lens, tables, scale, BLOCK, impl="topk")
    torch.testing.assert_close(scores, legacy, rtol=1e-5, atol=1e-4)
    num_selected, pages = 2048 // page, BLOCK // page
    got = quest_select(q, bounds, lens, tables, scale, BLOCK, num_selected, 1, 2, config=config)
    # the same scores through the reference selection: the same pages, tie for tie
    assert torch.equal(got, select_pages(scores, lens, page, num_selected, pages, 2 * pages))
    assert torch.equal(select_pages_triton(want.float(), lens, page, num_selected, pages, 2 * pages, config=config),
                       select_pages(want.float(), lens, page, num_selected, pages, 2 * pages))


@pytest.mark.parametrize("page", [16, 8])
def test_stream_selection_equals_reference_on_exact_scores(page: int) -> None:
    """Integer queries and bounds (exact in bf16 and in any fp32 summation order): the reference's pages exactly,
    with many ties."""
    g = torch.Generator(device="cuda").manual_seed(1)
    batch, blocks_per_seq = 4, 300
    num_blocks = batch * blocks_per_seq
    lowest = torch.randint(-4, 4, (num_blocks, BLOCK // page, KV_HEADS, DIM), device="cuda", generator=g).float()
    highest = lowest + torch.randint(0, 3, lowest.shape, device="cuda", generator=g).float()
    bounds = torch.stack([lowest, highest], dim=2).to(torch.bfloat16)
    q = torch.randint(-2, 3, (batch, HEADS, DIM), device="cuda", generator=g).to(torch.bfloat16)
    tables = torch.randperm(num_blocks, device="cuda", generator=g).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.tensor([4800, 3001, 17, 0], dtype=torch.int32, device="cuda")
    num_selected = 1024 // page
    got = quest_select(q, bounds, lens, tables, 0.25, BLOCK, num_selected, 1, 2)
    assert torch.equal(got, quest_select_ref(q, bounds, lens, tables, 0.25, BLOCK, num_selected, 1, 2))


@pytest.mark.parametrize("page", [16, 8])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_stream_step_in_cuda_graph(page: int, cache_dtype: torch.dtype) -> None:
    """Selection + sparse attention (Triton merge) captured once and replayed on new queries: the eager result;
    the earlier path ("topk" + torch merge) agrees on the output when it selects the same pages."""
    q, k, v, lens, tables, bounds = case(4, 8192, page, seed=2, cache_dtype=cache_dtype)
    k_scale = K_SCALE if cache_dtype == FP8 else 1.0
    scale, num_selected = DIM ** -0.5, 2048 // page
    bound_scale = score_scale(bounds, scale, k_scale)
    out = torch.empty_like(q)

    def step() -> None:
        selected = quest_select(q, bounds, lens, tables, bound_scale, BLOCK, num_selected, 1, 2)
        sparse_paged_decode(q, k, v, lens, tables, selected, scale, k_scale, out=out, page_size=page)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        step()
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    selected = quest_select(q, bounds, lens, tables, bound_scale, BLOCK, num_selected, 1, 2)
    eager = sparse_paged_decode(q, k, v, lens, tables, selected, scale, k_scale, page_size=page)
    torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
    legacy_sel = quest_select(q, bounds, lens, tables, bound_scale, BLOCK, num_selected, 1, 2, impl="topk")
    legacy = sparse_paged_decode(q, k, v, lens, tables, legacy_sel, scale, k_scale, page_size=page,
                                 merge="torch")
    same = (legacy_sel == selected).all(dim=-1).all(dim=-1)  # per sequence: every KV head's pages
    assert same.float().mean() >= 0.5  # random scores: ties are rare
    torch.testing.assert_close(legacy[same].float(), eager[same].float(), rtol=2e-2, atol=2e-2)
