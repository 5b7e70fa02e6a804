"""GPU-only: the small-T fused MoE path (`kernels/moe_small_t.py`) at the Qwen3-30B-A3B and Mixtral-8x7B layer
shapes, T = 1..8, in BF16 and with FP8 experts (per channel, and block (128, 128) as Qwen3-FP8 ships), against
its reference, captured in a CUDA graph, and selected by `fused_moe`. Run on the H200:
`.venv/bin/python -m pytest -q tests/gpu/test_moe_small_t_gpu.py`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_fused_moe_gpu import MODELS, assert_close, make_batch, make_weights, quantize_weight

from kestrel.kernels import fused_moe as fm
from kestrel.kernels import moe_small_t as st

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS = [1, 2, 4, 8]
QUANTS = {"bf16": "bf16", "channel": None, "block": (128, 128)}
# Kernel and reference hold the intermediate and the output in x's dtype from fp32 values that differ in
# accumulation order only (and, FP8, where the weight scale is applied): one bf16 unit near a rounding tie, rarely.
NORM_RTOL = 2.0**-9
ELEM_RTOL = 2.0**-7
# W8A16 against the grouped GEMM's W8A8 (activations quantized to e4m3): the e4m3 steps of x and the intermediate.
W8A8_NORM_RTOL = 0.1  # measured 0.042-0.046 (CPU, Qwen3-like rows, 4 tokens)


@pytest.fixture(scope="module", params=[(m, q) for m in MODELS for q in QUANTS], ids=lambda p: f"{p[0]}-{p[1]}")
def layer(request):
    name, quant = request.param
    w13, w2 = make_weights(name)
    if quant == "bf16":
        yield name, w13, w2, {}
    else:
        block = QUANTS[quant]
        q13, s13 = quantize_weight(w13, block)
        q2, s2 = quantize_weight(w2, block)
        del w13, w2
        yield name, q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=block)
    torch.cuda.empty_cache()


@pytest.mark.parametrize("T", TOKENS)
def test_kernel_matches_reference(layer, T):
    name, w13, w2, quant = layer
    x, weights, ids = make_batch(name, T, seed=T)
    out = st.fused_moe_small_t(x, w13, w2, weights, ids, **quant)
    assert_close(out, st.fused_moe_small_t_ref(x, w13, w2, weights, ids, **quant), NORM_RTOL, ELEM_RTOL)
    split = dataclasses.replace(st.DEFAULT, split_down=True)  # the same operations in the same order, but the
    # fused loop's weighting may compile to an FMA: a last-bit rounding apart (bf16's 2^-8 relative step)
    torch.testing.assert_close(st.fused_moe_small_t(x, w13, w2, weights, ids, config=split, **quant).float(),
                               out.float(), rtol=2.0**-7, atol=2.0**-7 * out.float().abs().max().item())
    # The selection in fused_moe runs the same kernel; its grouped GEMM is the other numerics (W8A8 for FP8).
    assert torch.equal(fm.fused_moe(x, w13, w2, weights, ids, small_t=True, **quant), out)
    grouped = fm.fused_moe(x, w13, w2, weights, ids, small_t=False, **quant)
    rel = ((grouped.float() - out.float()).norm() / out.float().norm()).item()
    assert rel <= (W8A8_NORM_RTOL if quant else 2 * NORM_RTOL)  # BF16: two kernels, each within NORM_RTOL


def test_skipped_pairs(layer):
    name, w13, w2, quant = layer
    x, weights, ids = make_batch(name, 4, seed=9)
    ids[0] = -1
    ids[2, 0] = -1
    out = st.fused_moe_small_t(x, w13, w2, weights, ids, **quant)
    assert bool((out[0] == 0).all())
    assert_close(out, st.fused_moe_small_t_ref(x, w13, w2, weights, ids, **quant), NORM_RTOL, ELEM_RTOL)


@pytest.mark.parametrize("T", [1, 8])
def test_cuda_graph_capture(layer, T):
    """Captured once, replayed on new inputs and routing: the eager output of those inputs, bit for bit."""
    name, w13, w2, quant = layer
    x, weights, ids = make_batch(name, T, seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        st.fused_moe_small_t(x, w13, w2, weights, ids, **quant)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = st.fused_moe_small_t(x, w13, w2, weights, ids, **quant)
    for seed in (3, 5):
        new_x, new_weights, new_ids = make_batch(name, T, seed=seed)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids.to(ids.dtype))
        graph.replay()
        assert torch.equal(static_out, st.fused_moe_small_t(new_x, w13, w2, new_weights, new_ids, **quant))
