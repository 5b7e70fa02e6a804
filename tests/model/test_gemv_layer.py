"""Linear layers on the decode GEMV (`kernels/gemv.py`): with a tuning table entry for the layer's weight kind and
shape (a fake table here, injected for the CPU device) an FP8 layer runs the GEMV (W8A16) up to the entry's `max_m`
rows, its output is the dequantized weights against the unquantized activations, and the fused producers (norm,
gated activation) emit model-dtype activations for those M and 8-bit ones above; a 16-bit layer runs it up to
`max_m` and `F.linear` above. Without a table nothing changes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kestrel.config import QuantConfig
from kestrel.kernels import common
from kestrel.kernels import gemv as gv
from kestrel.model.layers.activation import GatedActivation
from kestrel.model.layers.norm import RMSNorm
from kestrel.quant.base import QuantAct

sys.path.insert(0, str(Path(__file__).parent))
from test_quantized import BF16_REL, make_layer, oracle  # noqa: E402

N, K, MAX_M = 24, 40, 4


@pytest.fixture
def table(monkeypatch):
    """A GPU table for every device: the GEMV on for weights [N, K] up to MAX_M rows."""
    tiles = gv.GemvConfig(block_n=8, block_k=16, max_m=MAX_M).to_json()
    configs = {gv.table_key("fp8", N, K): tiles, gv.table_key("w16", N, K): tiles}
    monkeypatch.setattr(common, "gpu_table", lambda kernel, device: configs if kernel == gv.TABLE else {})
    return configs


def w8a16_oracle(layer, x: torch.Tensor) -> torch.Tensor:
    w = layer.weight.double() * layer.weight_scale.double()
    return x.double() @ w.T + layer.bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_gemv_up_to_max_m_then_w8a8(table, dtype):
    layer, weight, bias = make_layer(QuantConfig(method="fp8"), n=N, k=K, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    for M in (1, 2, MAX_M):
        x = torch.randn(M, K, generator=g).to(dtype)
        assert layer.input_quant(M) is None
        out = layer(x)
        ref = w8a16_oracle(layer, x)
        if dtype == torch.float32:
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        else:
            err = (out.double() - ref).abs()
            assert bool((err <= BF16_REL * ref.abs() + 1e-6 * ref.abs().max()).all())
        # W8A16 against the unquantized layer: only the weights' e4m3 error.
        exact = x.double() @ weight.double().T + bias.double()
        assert (out.double() - exact).norm() / exact.norm() < 2.0**-4
    x = torch.randn(MAX_M + 1, K, generator=g).to(dtype)
    assert layer.input_quant(MAX_M + 1) is not None
    out = layer(x)
    ref = oracle(layer, x)  # W8A8: the method's own activation quantizer
    err = (out.double() - ref).abs()
    assert bool((err <= BF16_REL * ref.abs() + 1e-6 * ref.abs().max()).all())


def test_off_without_table_or_for_other_shapes_and_int8(table):
    layer, _, _ = make_layer(QuantConfig(method="fp8"), n=N, k=K + 8)
    assert layer.input_quant(1) is not None  # no entry for [N, K + 8]
    int8, _, _ = make_layer(QuantConfig(method="int8"), n=N, k=K)
    assert int8.input_quant(1) is not None
    fp8, _, _ = make_layer(QuantConfig(method="fp8"), n=N, k=K)
    assert fp8.input_quant() is not None  # no size asked: the producer's usual 8-bit input
    table.clear()
    fresh, _, _ = make_layer(QuantConfig(method="fp8"), n=N, k=K)
    assert fresh.input_quant(1) is not None


def test_off_by_default_on_cpu():
    layer, _, _ = make_layer(QuantConfig(method="fp8"), n=N, k=K)
    assert layer.input_quant(1) is not None


def test_producers_emit_model_dtype_for_gemv_sizes(table):
    layer, _, _ = make_layer(QuantConfig(method="fp8"), n=N, k=K)
    norm = RMSNorm(K)
    g = torch.Generator().manual_seed(5)
    for M, quantized in ((1, False), (MAX_M, False), (MAX_M + 1, True)):
        x = torch.randn(M, K, generator=g)
        act, residual = norm.feed(x, None, layer)
        assert isinstance(act, QuantAct) == quantized
        assert torch.equal(residual, x)
        if not quantized:
            torch.testing.assert_close(layer(act), layer(norm(x)))
        gated = GatedActivation("silu")
        h = torch.randn(M, 2 * K, generator=g)
        assert isinstance(gated.feed(h, layer), QuantAct) == quantized


def test_16_bit_layer_runs_the_gemv_up_to_max_m(table, monkeypatch):
    layer, weight, bias = make_layer(QuantConfig(), n=N, k=K, dtype=torch.bfloat16)
    calls = []
    real = gv.gemv_ref
    monkeypatch.setattr(gv, "gemv_ref", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    g = torch.Generator().manual_seed(4)
    for M in (1, MAX_M, MAX_M + 1):
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        out = layer(x)
        exact = x.double() @ weight.double().T + bias.double()
        err = (out.double() - exact).abs()
        assert bool((err <= BF16_REL * exact.abs() + 1e-6 * exact.abs().max()).all())
    assert calls == [1, MAX_M]  # M = MAX_M + 1 went to F.linear
    table.clear()
    fresh, _, _ = make_layer(QuantConfig(), n=N, k=K, dtype=torch.bfloat16)
    fresh(torch.randn(1, K, generator=g).to(torch.bfloat16))
    assert calls == [1, MAX_M]


def test_a_moe_router_on_the_gemv_routes_in_it(tmp_path, monkeypatch):
    """An MoE block whose router has a GEMV table entry routes through `ops.moe_route_gemv` up to the entry's
    max_m rows (the router GEMV's logits, then the softmax top-k: on a GPU one launch, with the `router_topk`
    launch feature), and through the router's own output and `ops.moe_route` above; the same choices either way
    as the GEMV's logits give."""
    from kestrel import LLM, ops
    from kestrel.kernels import moe_routing
    from kestrel.loader.model_init import write_tiny_checkpoint
    from kestrel.model.layers.moe import MoEMLP

    write_tiny_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe", seed=5)
    llm = LLM(str(tmp_path / "qwen3_moe"), device="cpu", dtype="bfloat16", max_model_len=64,
              enable_prefix_caching=False, disable_log_stats=True)
    block = next(m for m in llm.runner.model.modules() if isinstance(m, MoEMLP))
    router = block.in_proj
    experts, hidden = router.weight.shape
    tiles = gv.GemvConfig(block_n=8, block_k=16, max_m=MAX_M).to_json()
    monkeypatch.setattr(common, "gpu_table",
                        lambda kernel, device: {gv.table_key("w16", experts, hidden): tiles} if kernel == gv.TABLE
                        else {})
    router.__dict__.pop("decode_gemv_config", None)  # looked up again under the table
    fused = []
    real = ops.moe_route_gemv
    monkeypatch.setattr(ops, "moe_route_gemv", lambda *a, **k: fused.append(a[0].shape[0]) or real(*a, **k))
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for M in (1, MAX_M, MAX_M + 1):
            x = torch.randn(M, hidden, generator=g).to(torch.bfloat16)
            weights, ids = block.route(x)
            expected = moe_routing.route_topk_ref(gv.gemv_ref(x, router.weight, None, x.dtype) if M <= MAX_M
                                                  else router(x), block.top_k, block.renormalize)
            assert torch.equal(ids, expected[1]) and torch.equal(weights, expected[0])
    assert fused == [1, MAX_M]
