"""GPU-only: the decode GEMV (`kernels/gemv.py`) compiled on the GPU, at every config of the GPU's tuning table and
at the real layer shapes it serves, against a float64 oracle (FP8: dequantized e4m3 weights times unquantized
activations; 16-bit weights as they are), M = 1..8, then captured in a CUDA graph and replayed on new inputs
(skipped on CPU). Run on the H200: `.venv/bin/python -m pytest -q tests/gpu/test_gemv_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels import common
from kestrel.kernels import gemv as gv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


FALLBACK = [("fp8", 2048, 4096, gv.GemvConfig(max_m=8)), ("w16", 6144, 4096, gv.GemvConfig(block_k=256, max_m=8)),
            # one K slice of Llama-3-8B's down (a K tail), split sums of its gate_up on 128 values a thread
            ("fp8", 4096, 14336, gv.GemvConfig(block_n=4, block_k=16384, num_warps=8, max_m=8)),
            ("fp8", 28672, 4096, gv.GemvConfig(block_n=16, block_k=1024, max_m=8))]


def _table() -> list[tuple[str, int, int, gv.GemvConfig]]:
    if not torch.cuda.is_available():
        return []
    out = []
    for key, cfg in common.gpu_table(gv.TABLE, torch.device("cuda")).items():
        kind, shape = key.split(":")
        out.append((kind, *map(int, shape.split(",")), gv.GemvConfig(**cfg)))
    return out


def _make(kind: str, M: int, N: int, K: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(N, K, generator=g, device="cuda") / K**0.5
    if kind == "w16":
        return x, w.to(torch.bfloat16), None
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    return x, (w / scale).to(torch.float8_e4m3fn), scale.float()


def _oracle(x, w, scale) -> torch.Tensor:
    return x.double() @ (w.double() * (scale.double() if scale is not None else 1.0)).T


@pytest.mark.parametrize("M", range(1, 9))
def test_table_configs_match_the_oracle_at_their_shapes(M):
    for kind, N, K, cfg in _table() + FALLBACK:
        x, w, scale = _make(kind, M, N, K, seed=M)
        out = gv.gemv(x, w, scale, torch.bfloat16, config=cfg)
        ref = _oracle(x, w, scale)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel <= 2.0**-8, (kind, N, K, cfg, rel)
    assert int(common.arrival_counters(torch.device("cuda")).count_nonzero()) == 0


@pytest.mark.parametrize("entry", range(2))
def test_graph_replay_equals_eager(entry):
    kind, N, K, cfg = (_table() + FALLBACK)[entry]
    x, w, scale = _make(kind, 1, N, K, seed=11)
    gv.gemv(x, w, scale, torch.bfloat16, config=cfg)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = gv.gemv(x, w, scale, torch.bfloat16, config=cfg)
    new_x, _, _ = _make(kind, 1, N, K, seed=12)
    x.copy_(new_x)
    for _ in range(3):
        graph.replay()
    assert torch.equal(static_out, gv.gemv(new_x, w, scale, torch.bfloat16, config=cfg))


@pytest.mark.parametrize("M", [1, 2, 4, 8])
def test_routing_gemv_is_the_gemv_then_the_routing_launch(M, monkeypatch):
    """With the `router_topk` launch feature on: the router GEMV that routes in its last column block gives the
    ids of the GEMV followed by the routing launch, and its weights to the last bit or so (the softmax's sum runs
    with the GEMV's warps, in another order), at Qwen3-30B-A3B's router (128 x 2048, top-8) with the table's
    tiles, eagerly and replayed in a CUDA graph; the counters are left zeroed."""
    from kestrel.kernels import moe_routing

    monkeypatch.setattr(common, "launch_feature", lambda name, device: True)
    cfg = next((c for kind, N, K, c in _table() if (kind, N, K) == ("w16", 128, 2048)), gv.GemvConfig(max_m=8))
    x, w, _ = _make("w16", M, 128, 2048, seed=M)
    weights, ids = gv.gemv_route(x, w, 8, True, config=cfg)
    expected = moe_routing.route_topk(gv.gemv(x, w, None, torch.bfloat16, config=cfg), 8, True)
    assert torch.equal(ids, expected[1]) and torch.allclose(weights, expected[0], rtol=2.0**-20, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = gv.gemv_route(x, w, 8, True, config=cfg)
    new_x, _, _ = _make("w16", M, 128, 2048, seed=M + 100)
    x.copy_(new_x)
    for _ in range(3):
        graph.replay()
    expected = moe_routing.route_topk(gv.gemv(new_x, w, None, torch.bfloat16, config=cfg), 8, True)
    assert torch.equal(static[1], expected[1]) and torch.allclose(static[0], expected[0], rtol=2.0**-20, atol=0)
    assert int(common.arrival_counters(torch.device("cuda")).count_nonzero()) == 0
