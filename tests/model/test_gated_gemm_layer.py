"""The FP8 gate/up GEMM that writes act(gate) * up (`ops.scaled_mm_gated`, launch feature `gated_gemm`): a dynamic
symmetric FP8 layer of a 16-bit model takes it on a GPU whose feature is on (here the switch, `w8a8.gated_gemm_on`,
is turned on for the CPU, where it is off by default) at steps of more than SMALL_M rows, from model-dtype or
already quantized input; decode-sized steps, static or INT8 layers, float32 models, an MLP with its fusions off and
the feature off keep the GEMM and the activation apart. A GatedMLP then hands the product to its down projection,
which quantizes it itself: the MLP's output against the separate launches differs only by the product's rounding
to the model dtype before its quantization (float64 oracle, norm-wise).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kestrel import ops
from kestrel.config import ModelConfig, QuantConfig
from kestrel.kernels.scaled_mm import SMALL_M
from kestrel.loader import load_model
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.layers.decoder import GatedMLP
from kestrel.quant import w8a8
from kestrel.quant.base import QuantAct

sys.path.insert(0, str(Path(__file__).parent))
from test_quantized import make_layer, oracle  # noqa: E402

N, K = 24, 40  # gate/up of 2 x 24 outputs


@pytest.fixture
def gated_on(monkeypatch):
    monkeypatch.setattr(w8a8, "gated_gemm_on", lambda device: True)


def test_off_on_the_cpu_by_default():
    layer, _, _ = make_layer(QuantConfig(method="fp8"), n=2 * N, k=K, dtype=torch.bfloat16)
    x = torch.randn(SMALL_M + 1, K).to(torch.bfloat16)
    assert not w8a8.gated_gemm_on(layer.weight.device)
    assert layer.apply_gated(x, "silu") is None


def gated_oracle(layer, x: torch.Tensor) -> torch.Tensor:
    """float64: the W8A8 output (the method's own quantizer), then SiLU(gate) * up."""
    gate, up = oracle(layer, x).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def test_steps_over_small_m_take_the_gated_gemm(gated_on):
    layer, _, _ = make_layer(QuantConfig(method="fp8"), n=2 * N, k=K, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SMALL_M + 9, K, generator=g).to(torch.bfloat16)
    out = layer.apply_gated(x, "silu")
    assert out is not None and out.shape == (SMALL_M + 9, N) and out.dtype == torch.bfloat16
    act = layer.quant_method.quantize_input(layer, x)
    want = ops.scaled_mm_gated(act.q, layer.weight, act.scale, layer.weight_scale, torch.bfloat16, "silu", layer.bias)
    assert torch.equal(out, want)
    ref = gated_oracle(layer, x)
    assert (out.double() - ref).norm() <= 2.0**-7 * ref.norm()
    # Already quantized input (a fused norm's) gives the same.
    assert torch.equal(layer.apply_gated(QuantAct(act.q, act.scale, None), "silu"), out)


def test_the_gemm_and_activation_stay_apart_elsewhere(gated_on, monkeypatch):
    g = torch.Generator().manual_seed(2)
    bf16, _, _ = make_layer(QuantConfig(method="fp8"), n=2 * N, k=K, dtype=torch.bfloat16)
    many = torch.randn(SMALL_M + 1, K, generator=g).to(torch.bfloat16)
    assert bf16.apply_gated(many[:SMALL_M], "silu") is None  # decode-sized
    fp32, _, _ = make_layer(QuantConfig(method="fp8"), n=2 * N, k=K, dtype=torch.float32)
    assert fp32.apply_gated(many.float(), "silu") is None
    int8, _, _ = make_layer(QuantConfig(method="int8"), n=2 * N, k=K, dtype=torch.bfloat16)
    assert int8.apply_gated(many, "silu") is None
    plain, _, _ = make_layer(QuantConfig(method=None), n=2 * N, k=K, dtype=torch.bfloat16)
    assert plain.apply_gated(many, "silu") is None
    assert bf16.apply_gated(many, "silu") is not None
    monkeypatch.setattr(w8a8, "gated_gemm_on", lambda device: False)
    assert bf16.apply_gated(many, "silu") is None


@pytest.fixture(scope="module")
def fp8_mlp(tmp_path_factory) -> GatedMLP:
    path = tmp_path_factory.mktemp("gated-gemm")
    write_tiny_checkpoint(path, arch="llama", size="tiny", seed=4)
    model = load_model(ModelConfig(model=str(path), dtype="bfloat16"), QuantConfig(method="fp8"), "cpu")
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, GatedMLP)
    return mlp


def test_a_gated_mlp_hands_the_product_to_its_down_projection(fp8_mlp, gated_on, monkeypatch):
    calls = []
    real = ops.scaled_mm_gated

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "scaled_mm_gated", counted)
    hidden = fp8_mlp.gate_up_proj.input_size
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SMALL_M + 30, hidden, generator=g).to(torch.bfloat16)
    fused = fp8_mlp(x)
    assert calls == [SMALL_M + 30]
    fp8_mlp(x[:SMALL_M])
    assert calls == [SMALL_M + 30]  # decode-sized: the separate launches
    unfused = fp8_mlp(x, fuse=False)
    assert calls == [SMALL_M + 30]  # the fusions off: the separate launches
    monkeypatch.setattr(w8a8, "gated_gemm_on", lambda device: False)
    apart = fp8_mlp(x)
    # Unfused, the product is rounded to bf16 too (then quantized by the down projection), as the gated path does.
    assert (fused.double() - unfused.double()).norm() <= 2.0**-7 * unfused.double().norm()
    assert calls == [SMALL_M + 30]
    # Separately, the product is quantized from fp32; gated, from its bf16 rounding: a few FP8 steps apart at most.
    assert (fused.double() - apart.double()).norm() <= 2.0**-5 * apart.double().norm()
    gate_up = fp8_mlp.gate_up_proj
    exact = gated_oracle(gate_up, x)
    assert (fused.double() - fp8_mlp.down_proj(exact.to(torch.bfloat16)).double()).norm() \
        <= 2.0**-5 * apart.double().norm()
