"""GPU-only: the grammar-bitmask kernel compiled on the GPU at a real vocabulary (128,256 tokens, a mask of 4,008
words) equals its reference bit for bit, in a CUDA-graph replay too (skipped on CPU)."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_vocabulary(dtype):
    g = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(80, 128256, device="cuda", generator=g).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (64, 4008), device="cuda", generator=g,
                            dtype=torch.int64).to(torch.int32)
    rows = torch.randperm(80, device="cuda", generator=g)[:64]
    expected = apply_token_bitmask_ref(logits.clone(), bitmask, rows)
    out = logits.clone()
    apply_token_bitmask(out, bitmask, rows)
    assert torch.equal(out, expected)
    graph_logits = logits.clone()
    graph = torch.cuda.CUDAGraph()
    apply_token_bitmask(graph_logits, bitmask, rows)  # compiled before the capture
    with torch.cuda.graph(graph):
        apply_token_bitmask(graph_logits, bitmask, rows)
    graph_logits.copy_(logits)
    bitmask.bitwise_not_()
    graph.replay()
    assert torch.equal(graph_logits, apply_token_bitmask_ref(logits.clone(), bitmask, rows))
