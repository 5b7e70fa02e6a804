"""GPU-only: split-KV decode attention whose last split merges the partials (`split_merge="fused"`, the default)
against the merge in a launch of its own, compiled at the 8B shape (32 / 8 heads of 128), BF16 and FP8 caches, dense
paged decode and Quest's sparse attention: bit for bit equal, through many CUDA-graph replays with new queries each
time (a race between the splits would show as a difference), and the arrival counts left at zero. Run on the H200:
`.venv/bin/python -m pytest -q tests/gpu/test_split_merge_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels import common
from kestrel.kernels.attention import paged_attention
from kestrel.kernels.sparse_decode import sparse_paged_decode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK = 16
HEADS, KV_HEADS, DIM = 32, 8, 128
FP8 = torch.float8_e4m3fn
REPLAYS = 25


def caches(batch: int, context: int, cache_dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    scale = 1 / 32 if cache_dtype == FP8 else 1.0
    shape = (num_blocks, BLOCK, KV_HEADS, DIM)
    k = (torch.randn(shape, generator=g, device="cuda") / scale).to(cache_dtype)
    v = (torch.randn(shape, generator=g, device="cuda") / scale).to(cache_dtype)
    tables = torch.randperm(num_blocks, generator=g, device="cuda").view(batch, blocks_per_seq).int()
    # every sequence a different length, the first one short: splits left empty, partial tiles
    lens = torch.linspace(max(1, context // 7), context, batch, device="cuda").int()
    return k, v, tables, lens, scale, g


def replay_and_compare(run_fused, run_launch, q: torch.Tensor, g: torch.Generator) -> None:
    """Capture `run_fused` (writing its output buffer), then replay it with new queries, each output against the
    launched merge's, eagerly."""
    run_fused()  # the counts' buffer is allocated outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_out = run_fused()
    for _ in range(REPLAYS):
        q.copy_(torch.randn(q.shape, generator=g, device="cuda").to(q.dtype))
        graph.replay()
        assert torch.isfinite(fused_out).all()
        assert torch.equal(fused_out, run_launch())
    torch.cuda.synchronize()
    assert int(common.split_counters(q.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("batch,context,splits", [(1, 4096, 32), (4, 2048, 8), (16, 777, 4), (64, 300, 2)])
def test_dense_decode_fused_merge_under_graph_replays(batch: int, context: int, splits: int,
                                                      cache_dtype: torch.dtype) -> None:
    k, v, tables, lens, scale, g = caches(batch, context, cache_dtype, seed=batch)
    q = torch.randn(batch, HEADS, DIM, generator=g, device="cuda").bfloat16()
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    fused_out, launch_out = torch.empty_like(q), torch.empty_like(q)

    def run(merge: str, out: torch.Tensor) -> torch.Tensor:
        return paged_attention(q, k, v, starts, lens, tables, DIM ** -0.5, None, scale, scale, out=out,
                               max_query_len=1, num_splits=splits, split_merge=merge)

    replay_and_compare(lambda: run("fused", fused_out), lambda: run("launch", launch_out), q, g)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("batch,splits", [(1, 16), (8, 4), (32, 2)])
def test_sparse_decode_fused_merge_under_graph_replays(batch: int, splits: int, cache_dtype: torch.dtype) -> None:
    context, num_selected = 8192, 64
    k, v, tables, lens, scale, g = caches(batch, context, cache_dtype, seed=100 + batch)
    q = torch.randn(batch, HEADS, DIM, generator=g, device="cuda").bfloat16()
    pages = (lens.long()[:, None, None] + BLOCK - 1) // BLOCK
    picks = torch.rand(batch, KV_HEADS, 2 * num_selected, generator=g, device="cuda").argsort(-1)[..., :num_selected]
    selected = torch.where(picks < pages, picks, -1).sort(-1).values.int()
    fused_out, launch_out = torch.empty_like(q), torch.empty_like(q)

    def run(merge: str, out: torch.Tensor) -> torch.Tensor:
        return sparse_paged_decode(q, k, v, lens, tables, selected, DIM ** -0.5, scale, scale, out=out,
                                   num_splits=splits, merge=merge)

    replay_and_compare(lambda: run("fused", fused_out), lambda: run("triton", launch_out), q, g)
