"""GPU-only: the FP8 weight GEMV (`kernels/fp8_gemv.py`) compiled on the GPU, at every config of the GPU's tuning
table and at the real layer shapes it serves, against a float64 oracle of W8A16 (dequantized e4m3 weights times
unquantized activations), M = 1..8, then captured in a CUDA graph and replayed on new inputs (skipped on CPU).
Run on the H200: `.venv/bin/python -m pytest -q tests/gpu/test_fp8_gemv_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels import common
from kestrel.kernels import fp8_gemv as fg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _table() -> list[tuple[int, int, fg.FP8GemvConfig]]:
    if not torch.cuda.is_available():
        return []
    entries = common.gpu_table("fp8_gemv", torch.device("cuda"))
    return [(*map(int, key.split(",")), fg.FP8GemvConfig(**cfg)) for key, cfg in entries.items()]


def _make(M: int, N: int, K: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(N, K, generator=g, device="cuda") / K**0.5
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    q = (w / scale).to(torch.float8_e4m3fn)
    return x, q, scale.float()


def _oracle(x, q, scale) -> torch.Tensor:
    return x.double() @ (q.double() * scale.double()).T


@pytest.mark.parametrize("M", range(1, 9))
def test_table_configs_match_the_oracle_at_their_shapes(M):
    entries = _table() or [(2048, 4096, fg.FP8GemvConfig(max_m=8))]
    for N, K, cfg in entries:
        x, q, scale = _make(M, N, K, seed=M)
        out = fg.fp8_gemv(x, q, scale, torch.bfloat16, config=cfg)
        ref = _oracle(x, q, scale)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel <= 2.0**-8, (N, K, cfg, rel)


def test_graph_replay_equals_eager():
    N, K, cfg = (_table() or [(2048, 4096, fg.FP8GemvConfig(max_m=8))])[0]
    x, q, scale = _make(1, N, K, seed=11)
    fg.fp8_gemv(x, q, scale, torch.bfloat16, config=cfg)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fg.fp8_gemv(x, q, scale, torch.bfloat16, config=cfg)
    new_x, _, _ = _make(1, N, K, seed=12)
    x.copy_(new_x)
    graph.replay()
    assert torch.equal(static_out, fg.fp8_gemv(new_x, q, scale, torch.bfloat16, config=cfg))
