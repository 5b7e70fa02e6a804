"""GELU / GELU-tanh activations (gated and plain), Gemma's unit-offset RMSNorm and LayerNorm: Triton kernels
(interpreted on CPU) and their references against float64 oracles.

Bounds follow the roundings each op is specified to make (one, to the output dtype) plus fp32 slack for the
in-kernel math:
- activations: `u * |y|` for the final rounding; fp32 `exp` of an argument `t` carries a relative error of
  about `|t|` fp32 units; `1 + erf(z)` for negative z cancels, an absolute error of a few fp32 units of
  `|gate * up|` (torch computes the same expression in fp32 and shares that error).
- unit-offset RMSNorm and LayerNorm: normalized, scaled (and shifted) in fp32, rounded once.
"""

from __future__ import annotations

import math

import pytest
import torch

from kestrel import ops
from kestrel.kernels import activation as act_mod
from kestrel.kernels.norm import layer_norm, layer_norm_ref, rms_norm, rms_norm_ref

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FP32 = 2.0**-24
CPU = torch.device("cpu")


def subnormal_slack(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).smallest_normal * UNIT_ROUNDOFF[dtype]


def strided(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The same values as a column slice of a wider tensor on `device`: rows are not contiguous."""
    wide = torch.zeros(rows.shape[0], rows.shape[1] + 7, dtype=rows.dtype)
    wide[:, 3:3 + rows.shape[1]] = rows
    return wide.to(device)[:, 3:3 + rows.shape[1]]


# ------------------------------------------------------------------------------------------------ activations


def act_oracle(g: torch.Tensor, activation: str) -> torch.Tensor:
    """float64, the textbook formulas (HF's GELUActivation python form and NewGELUActivation)."""
    g = g.double()
    if activation == "silu":
        return g / (1.0 + torch.exp(-g))
    if activation == "gelu":
        return 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0)))
    return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))


def act_bound(y: torch.Tensor, g: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    g, up = g.double(), up.double()
    exp_arg = 1.6 * (g.abs() + 0.045 * g.abs() ** 3)  # the largest exp argument of the three activations
    return ((UNIT_ROUNDOFF[dtype] + 32 * FP32 * (1 + exp_arg)) * y.abs() + 8 * FP32 * (g * up).abs()
            + subnormal_slack(dtype))


def act_case(num_rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, width, generator=g) * 3
    x[0, :9] = torch.tensor([-80.0, -20.0, -5.0, -1e-3, 0.0, 1e-3, 3.0, 20.0, 80.0])
    return x.to(dtype)


ACTS = ["silu", "gelu", "gelu_tanh"]


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_act_mul_matches_oracle(device: torch.device, activation: str, dtype: torch.dtype) -> None:
    x = act_case(5, 2 * 200, dtype, seed=len(activation))
    gate, up = x.chunk(2, dim=-1)
    expected = act_oracle(gate, activation) * up.double()
    bound = act_bound(expected, gate, up, dtype)
    for out in (act_mod.act_mul(strided(x, device), activation).cpu(),
                act_mod.act_mul_ref(strided(x, CPU), activation)):
        assert out.shape == (5, 200) and out.dtype == dtype
        err = (out.double() - expected).abs()
        assert bool((err <= bound).all()), f"{activation}: max err/bound {(err / bound).max().item():.3f}"


@pytest.mark.parametrize("activation", ACTS)
def test_plain_act_matches_oracle(device: torch.device, activation: str) -> None:
    x = act_case(3, 1500, torch.float16, seed=7).view(3, 3, 500)  # more than one 1024-column block per row
    expected = act_oracle(x, activation)
    bound = act_bound(expected, x, torch.ones_like(x), torch.float16)
    for out in (act_mod.act(x.to(device), activation).cpu(), act_mod.act_ref(x, activation)):
        assert out.shape == x.shape and out.dtype == torch.float16
        assert bool(((out.double() - expected).abs() <= bound).all())


def test_gelu_variants_are_told_apart(device: torch.device) -> None:
    """fp32 bounds are tight enough that exact GELU and the tanh approximation cannot pass for each other."""
    x = act_case(2, 2 * 64, torch.float32, seed=3)
    gate, up = x.chunk(2, dim=-1)
    for activation, other in (("gelu", "gelu_tanh"), ("gelu_tanh", "gelu")):
        out = act_mod.act_mul(x.to(device), activation).cpu().double()
        wrong = act_oracle(gate, other) * up.double()
        assert bool(((out - wrong).abs() > act_bound(wrong, gate, up, torch.float32)).any())


def test_hf_activation_names_map_onto_the_same_functions() -> None:
    """Each HF `hidden_act` name in HF_ACTIVATIONS computes what our reference computes, in float64."""
    from transformers.activations import ACT2FN

    x = torch.linspace(-12.0, 12.0, 2001, dtype=torch.float64)
    for hf_name, ours in act_mod.HF_ACTIVATIONS.items():
        torch.testing.assert_close(act_mod.activate_ref(x, ours), ACT2FN[hf_name](x), rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(act_oracle(x, ours), ACT2FN[hf_name](x), rtol=1e-13, atol=1e-15)


def test_silu_mul_is_act_mul_silu(device: torch.device) -> None:
    x = act_case(4, 2 * 96, torch.bfloat16, seed=4).to(device)
    assert torch.equal(act_mod.silu_mul(x), act_mod.act_mul(x, "silu"))
    assert torch.equal(act_mod.silu_mul_ref(x.cpu()), act_mod.act_mul_ref(x.cpu(), "silu"))


def test_unknown_activation_and_odd_width_are_refused(device: torch.device) -> None:
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match="unknown activation"):
        act_mod.act_mul(x, "relu")
    with pytest.raises(ValueError, match="unknown activation"):
        act_mod.act_mul_ref(x.cpu(), "gelu_new")  # an HF name: callers map it through HF_ACTIVATIONS
    with pytest.raises(ValueError, match="even"):
        act_mod.act_mul(x[:, :7], "gelu")


def test_ops_dispatch_activations_on_cpu() -> None:
    x = act_case(3, 2 * 32, torch.float32, seed=5)
    assert torch.equal(ops.act_mul(x, "gelu_tanh"), act_mod.act_mul_ref(x, "gelu_tanh"))
    assert torch.equal(ops.act(x, "gelu"), act_mod.act_ref(x, "gelu"))


# ------------------------------------------------------------------------------------------------ norms


def norm_case(num_rows: int, hidden: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, hidden, generator=g) * 3
    x[0, :5] = torch.tensor([40.0, -40.0, 0.0, 1e-3, -0.5])
    residual = torch.randn(num_rows, hidden, generator=g)
    weight = 0.5 * torch.randn(hidden, generator=g)  # Gemma stores offsets from 1: around 0
    bias = torch.randn(hidden, generator=g)
    return x.to(dtype), residual.to(dtype), weight.to(dtype), bias.to(dtype)


def added(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return x if residual is None else (x.double() + residual.double()).to(x.dtype)


def gemma_oracle(x, weight, eps, residual):
    """HF GemmaRMSNorm in float64: `norm(h) * (1 + weight)`, no intermediate rounding."""
    hd = added(x, residual).double()
    return hd / torch.sqrt((hd * hd).mean(dim=-1, keepdim=True) + eps) * (1.0 + weight.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_unit_offset_rms_norm(device: torch.device, dtype: torch.dtype, with_residual: bool) -> None:
    eps = 1e-6
    x, residual, weight, _ = norm_case(19, 200, dtype, seed=11)
    r = residual if with_residual else None
    exact = gemma_oracle(x, weight, eps, r)
    u = UNIT_ROUNDOFF[dtype]
    bound = (u + 16 * FP32) * exact.abs() + 16 * FP32 * (1 + weight.double().abs()) + subnormal_slack(dtype)
    for fn, dev in ((rms_norm, device), (rms_norm_ref, CPU)):
        result = fn(strided(x, dev), weight.to(dev), eps, None if r is None else strided(r, dev), unit_offset=True)
        out, new_residual = result if with_residual else (result, None)
        assert out.dtype == dtype and out.shape == x.shape
        err = (out.cpu().double() - exact).abs()
        assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3f}"
        if with_residual:
            assert torch.equal(new_residual.cpu(), added(x, residual))
    # The offset really is added: the plain weight gives another result.
    plain = rms_norm(x.to(device), weight.to(device), eps).cpu().double()
    assert bool(((plain - exact).abs() > bound).any())


def test_unit_offset_keeps_the_input_dtype_with_an_fp32_weight(device: torch.device) -> None:
    """HF casts `type_as(x)`: an fp32 weight does not promote the output, unlike the Llama variant."""
    x, _, weight, _ = norm_case(3, 96, torch.bfloat16, seed=12)
    for out in (rms_norm(x.to(device), weight.float().to(device), 1e-6, unit_offset=True),
                rms_norm_ref(x, weight.float(), 1e-6, unit_offset=True),
                ops.rms_norm(x, weight.float(), 1e-6, None, True)):
        assert out.dtype == torch.bfloat16


def layer_norm_oracle(x, weight, bias, eps, residual):
    hd = added(x, residual).double()
    centred = hd - hd.mean(dim=-1, keepdim=True)
    y = centred / torch.sqrt((centred * centred).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("affine", ["weight_bias", "weight", "none"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm(device: torch.device, dtype: torch.dtype, affine: str, with_residual: bool) -> None:
    eps = 1e-5
    x, residual, weight, bias = norm_case(21, 200, dtype, seed=13)
    x[2] = 0.75  # constant row: variance 0, output = bias
    x[3] = (1000.0 + torch.randn(200)).to(dtype)  # large mean, unit spread: E[h^2] - mean^2 would cancel
    w = weight + 1.0 if affine != "none" else None
    b = bias if affine == "weight_bias" else None
    r = residual if with_residual else None
    if r is not None:
        r[2] = 0.25
    exact = layer_norm_oracle(x, w, b, eps, r)
    scaled = layer_norm_oracle(x, w, None, eps, r).abs()  # before the bias: the size of the fp32 error
    h = added(x, r).double()
    # fp32 error of the centred values grows with the row's mean relative to its spread
    spread = (h - h.mean(dim=-1, keepdim=True)).abs().amax(dim=-1, keepdim=True)
    mean_ratio = h.abs().amax(dim=-1, keepdim=True) / spread.clamp(min=1e-30)
    bound = (UNIT_ROUNDOFF[dtype] * exact.abs() + 16 * FP32 * (1 + mean_ratio) * (scaled + 1)
             + subnormal_slack(dtype))
    for fn, dev in ((layer_norm, device), (layer_norm_ref, CPU)):
        wd, bd = (None if t is None else t.to(dev) for t in (w, b))
        result = fn(strided(x, dev), wd, bd, eps, None if r is None else strided(r, dev))
        out, new_residual = result if with_residual else (result, None)
        assert out.dtype == dtype and out.shape == x.shape
        err = (out.cpu().double() - exact).abs()
        assert bool((err <= bound).all()), f"{fn.__name__}: max err/bound {(err / bound).max().item():.3f}"
        if with_residual:
            assert torch.equal(new_residual.cpu(), added(x, r))


def test_layer_norm_three_dim_empty_and_dispatch(device: torch.device) -> None:
    x, residual, weight, bias = norm_case(6, 64, torch.float32, seed=14)
    out, new_residual = layer_norm(x.view(2, 3, 64).to(device), weight.to(device), bias.to(device), 1e-5,
                                   residual.view(2, 3, 64).to(device))
    ref_out, ref_residual = layer_norm_ref(x, weight, bias, 1e-5, residual)
    assert out.shape == (2, 3, 64) and new_residual.shape == (2, 3, 64)
    torch.testing.assert_close(out.cpu().view(6, 64), ref_out, rtol=64 * FP32, atol=64 * FP32)
    assert torch.equal(new_residual.cpu().view(6, 64), ref_residual)
    assert layer_norm(x[:0].to(device), weight.to(device), bias.to(device), 1e-5).shape == (0, 64)
    assert torch.equal(ops.layer_norm(x, weight, bias, 1e-5), layer_norm_ref(x, weight, bias, 1e-5))
