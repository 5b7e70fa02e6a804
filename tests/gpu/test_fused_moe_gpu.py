"""GPU-only: the fused MoE kernel at real model shapes (bf16) against its reference, and the whole op, routing
sort included, captured in a CUDA graph (skipped on CPU). Run on the H200: `.venv/bin/python -m pytest -q
tests/gpu/test_fused_moe_gpu.py`; `python tests/gpu/test_fused_moe_gpu.py [--sweep]` times the default configs
(and a small config grid, the starting point of an H200 tuning table) at the same shapes.
"""

from __future__ import annotations

import argparse
import itertools
import math

import pytest
import torch

from kestrel.kernels.fused_moe import MoEConfig, fused_moe, fused_moe_ref, select_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# name: (E, k, H, I)
MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = [1, 8, 64, 512]
# Both sides hold the intermediate and the output in bf16 from fp32 values that differ only in accumulation
# order: they disagree by one bf16 unit where a value lies near a rounding tie, rarely.
NORM_RTOL = 2.0**-10
ELEM_RTOL = 2.0**-7


def make_weights(model: str, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    E, _, H, inter = MODELS[model]
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * inter, H, generator=g, device="cuda") / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g, device="cuda") / math.sqrt(inter)).to(dtype)
    return w13, w2


def make_batch(model: str, T: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    """x and a softmax top-k routing (weights renormalised over the k chosen, as Qwen3 and Mixtral do)."""
    E, k, H, _ = MODELS[model]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, generator=g, device="cuda").to(dtype)
    probs = torch.randn(T, E, generator=g, device="cuda").softmax(dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    return x, weights / weights.sum(dim=-1, keepdim=True), ids.to(torch.int32 if seed % 2 else torch.int64)


@pytest.fixture(scope="module", params=list(MODELS))
def model(request) -> tuple[str, torch.Tensor, torch.Tensor]:
    w13, w2 = make_weights(request.param)
    yield request.param, w13, w2
    del w13, w2
    torch.cuda.empty_cache()


@pytest.mark.parametrize("T", TOKENS)
def test_kernel_matches_reference(model, T):
    name, w13, w2 = model
    x, weights, ids = make_batch(name, T, seed=T)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    diff = (out.float() - ref.float()).abs()
    assert (diff.norm() / ref.float().norm()).item() <= NORM_RTOL
    assert bool((diff <= ELEM_RTOL * ref.float().abs() + ELEM_RTOL * ref.float().abs().max()).all())


@pytest.mark.parametrize("T", TOKENS)
def test_cuda_graph_capture(model, T):
    """Captured once, replayed on new inputs and routing: the eager output of those inputs, bit for bit."""
    name, w13, w2 = model
    x, weights, ids = make_batch(name, T, seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, w13, w2, weights, ids)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_moe(x, w13, w2, weights, ids)
    for seed in (3, 5):
        new_x, new_weights, new_ids = make_batch(name, T, seed=seed)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        assert torch.equal(static_out, fused_moe(new_x, w13, w2, new_weights, new_ids))


# --------------------------------------------------------------------------------------------- timing


def _time_us(fn) -> float:
    """Median of replays of a CUDA graph of `fn` (launch overhead as the engine sees it under graphs)."""
    import triton

    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median") * 1e3


def _grid() -> list[MoEConfig]:
    configs = []
    for bm, bn, bk, (warps, stages) in itertools.product((16, 32, 64), (64, 128), (64, 128), ((4, 3), (4, 4), (8, 4))):
        configs.append(MoEConfig(bm, bn, bk, 1 if bm == 16 else 8, warps, stages))
    return configs


def _bench(name: str, sweep: bool) -> None:
    E, k, H, inter = MODELS[name]
    w13, w2 = make_weights(name)
    for T in TOKENS:
        x, weights, ids = make_batch(name, T, seed=T)
        gbytes = ids.unique().numel() * 3 * H * inter * 2 / 1e9

        def run(cfg: MoEConfig) -> float:
            return _time_us(lambda: fused_moe(x, w13, w2, weights, ids, config=cfg))  # noqa: B023

        cfg = select_config(E, inter, H, T, x.device)
        us = run(cfg)
        line = f"{name} T={T}: default {us:.1f} us, {gbytes / us * 1e6:.0f} GB/s of expert weights ({cfg})"
        if sweep:
            timed = []
            for c in _grid():
                try:
                    timed.append((run(c), c))
                except Exception as exc:  # out of shared memory or registers at this shape
                    print(f"  skip {c}: {type(exc).__name__}")
            best_us, best = min(timed, key=lambda t: t[0])
            line += f"; best {best_us:.1f} us ({best})"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of configs per shape")
    args = parser.parse_args()
    for name in MODELS:
        _bench(name, args.sweep)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
