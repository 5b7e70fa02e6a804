"""RMSNorm (+ residual) and SiLU-mul: Triton kernels (interpreted on CPU) and their references vs float64 oracles.

Bounds are derived from the roundings each op is specified to make, plus fp32 slack for the in-kernel math:
- SiLU-mul is computed in fp32 and rounded once: `|out - y| <= u * |y|` (u = unit roundoff of the dtype).
  The bf16 PyTorch expression `F.silu(gate) * up` rounds twice and is checked to break this bound.
- RMSNorm follows HF Llama: the new residual is `x + residual` rounded once (bit exact against the oracle);
  the output rounds twice (normalized value to the input dtype, then the weight product), so
  `|out - y| <= 2u * |y|`, and almost every element equals the float64 oracle with those two roundings.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kestrel.kernels.activation import silu_mul, silu_mul_ref
from kestrel.kernels.norm import rms_norm, rms_norm_ref

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FP32 = 2.0**-24
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.float32, torch.bfloat16, torch.float16)]


def subnormal_slack(dtype: torch.dtype) -> float:
    """Half the spacing of the dtype's subnormals: the absolute error of one rounding near zero."""
    return torch.finfo(dtype).smallest_normal * UNIT_ROUNDOFF[dtype]


def strided_rows(rows: torch.Tensor, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """The same values as a column slice of a wider tensor on `device` (sliced there, so the rows keep their
    stride): rows are not contiguous."""
    wide = torch.randn(rows.shape[0], rows.shape[1] + 11, generator=gen).to(rows.dtype)
    wide[:, 5:5 + rows.shape[1]] = rows
    view = wide.to(device)[:, 5:5 + rows.shape[1]]
    assert view.stride(0) == rows.shape[1] + 11
    return view


# ------------------------------------------------------------------------------------------------ RMSNorm


def rms_oracle(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None):
    """float64: (exact output, output with the normalized value rounded to the dtype, new residual)."""
    h = x if residual is None else (x.double() + residual.double()).to(x.dtype)
    hd = h.double()
    normed = hd / torch.sqrt((hd * hd).mean(dim=-1, keepdim=True) + eps)
    w = weight.double()
    return w * normed, w * normed.to(x.dtype).double(), h


def check_rms(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
              residual: torch.Tensor | None) -> None:
    exact, hf_rounded, _ = rms_oracle(x, weight, eps, residual)
    u = UNIT_ROUNDOFF[x.dtype]
    # Reduction, rsqrt and products in fp32 before the roundings: a few fp32 units of the result.
    bound = (2 * u + 16 * FP32) * exact.abs() + 2 * subnormal_slack(x.dtype) * (1 + weight.double().abs())
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3f}"
    # Rounded to the input dtype before the weight (HF), not after: all but rare near-tie elements agree
    # with one rounding of the oracle that rounds there too.
    slack = 16 * FP32 * exact.abs() + subnormal_slack(x.dtype)
    one = (out.double() - hf_rounded).abs() <= u * hf_rounded.abs() + slack
    assert one.float().mean().item() >= 0.99


def rms_case(num_rows: int, hidden: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, hidden, generator=g) * 3
    x[0, :7] = torch.tensor([40.0, -40.0, 0.0, 1e-3, -1e-3, 5.0, -0.5])
    if num_rows > 2:
        x[2] *= 1e-3  # mean square ~1e-5: eps (1e-5 here) changes the result by a third
    residual = torch.randn(num_rows, hidden, generator=g)
    weight = 1.0 + 0.5 * torch.randn(hidden, generator=g)
    return x.to(dtype), residual.to(dtype), weight.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows,hidden", [(1, 96), (5, 200), (37, 96), (37, 200)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_oracle(device: torch.device, dtype: torch.dtype, num_rows: int, hidden: int,
                                 with_residual: bool) -> None:
    eps = 1e-5
    x, residual, weight = rms_case(num_rows, hidden, dtype, seed=num_rows * hidden)
    cpu = torch.device("cpu")
    for fn, dev in ((rms_norm, device), (rms_norm_ref, cpu)):
        g = torch.Generator().manual_seed(1)
        xs, rs = strided_rows(x, g, dev), strided_rows(residual, g, dev)
        x_before, r_before = xs.clone(), rs.clone()
        result = fn(xs, weight.to(dev), eps, rs if with_residual else None)
        assert torch.equal(xs, x_before) and torch.equal(rs, r_before), "the inputs must not be modified"
        if with_residual:
            out, new_residual = result
            expected_residual = rms_oracle(x, weight, eps, residual)[2]
            assert new_residual.dtype == dtype and torch.equal(new_residual.cpu(), expected_residual)
        else:
            out = result
        assert out.shape == x.shape and out.dtype == dtype
        check_rms(out.cpu(), x, weight, eps, residual if with_residual else None)


def test_rms_norm_promotes_to_an_fp32_weight(device: torch.device) -> None:
    """A float32 weight on bf16 activations gives a float32 output, as `weight * x.to(bf16)` does."""
    x, _, weight = rms_case(5, 200, torch.bfloat16, seed=3)
    weight = weight.float() + 1e-3
    exact, hf_rounded, _ = rms_oracle(x, weight, 1e-6, None)
    for out in (rms_norm(x.to(device), weight.to(device), 1e-6).cpu(), rms_norm_ref(x, weight, 1e-6)):
        assert out.dtype == torch.float32
        # One bf16 rounding (the normalized value); the fp32 weight product is nearly exact.
        assert bool(((out.double() - exact).abs() <= (2.0**-8 + 16 * FP32) * exact.abs()).all())
        close = (out.double() - hf_rounded).abs() <= 16 * FP32 * exact.abs()
        assert close.float().mean().item() >= 0.99


def test_rms_norm_of_three_dim_input_and_empty_batch(device: torch.device) -> None:
    x, residual, weight = rms_case(6, 96, torch.float32, seed=4)
    out, new_residual = rms_norm(x.view(2, 3, 96).to(device), weight.to(device), 1e-6,
                                 residual.view(2, 3, 96).to(device))
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
    assert out.shape == (2, 3, 96) and new_residual.shape == (2, 3, 96)
    torch.testing.assert_close(out.cpu().view(6, 96), ref_out, rtol=32 * FP32, atol=0)
    assert torch.equal(new_residual.cpu().view(6, 96), ref_residual)
    empty = rms_norm(x[:0].to(device), weight.to(device), 1e-6)
    assert empty.shape == (0, 96)


# ------------------------------------------------------------------------------------------------ SiLU-mul


def silu_oracle(x: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    inter = xd.shape[-1] // 2
    g, u = xd[..., :inter], xd[..., inter:]
    return g / (1.0 + torch.exp(-g)) * u


def silu_bound(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One rounding to `dtype`; the fp32 exp (ex2.approx on the GPU) and divide add a few fp32 units."""
    return (UNIT_ROUNDOFF[dtype] + 32 * FP32) * y.abs() + subnormal_slack(dtype)


def silu_case(num_rows: int, inter: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, 2 * inter, generator=g) * 3
    x[0, :7] = torch.tensor([-80.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 80.0])  # exp(80) still fits fp32
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows,inter", [(1, 96), (5, 200), (37, 96), (3, 1500)])
def test_silu_mul_matches_oracle(device: torch.device, dtype: torch.dtype, num_rows: int, inter: int) -> None:
    x = silu_case(num_rows, inter, dtype, seed=num_rows + inter)
    expected = silu_oracle(x)
    bound = silu_bound(expected, dtype)
    strided = lambda dev: strided_rows(x, torch.Generator().manual_seed(2), dev)  # noqa: E731
    for out in (silu_mul(strided(device)).cpu(), silu_mul_ref(strided(torch.device("cpu")))):
        assert out.shape == (num_rows, inter) and out.dtype == dtype
        err = (out.double() - expected).abs()
        assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3f}"


def test_silu_mul_rounds_once_where_torch_rounds_twice(device: torch.device) -> None:
    """The bound is tight enough to tell: bf16 `F.silu(gate) * up` (two roundings) breaks it."""
    x = silu_case(37, 200, torch.bfloat16, seed=5)
    expected = silu_oracle(x)
    bound = silu_bound(expected, torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    twice = (F.silu(gate) * up).double()
    assert bool(((twice - expected).abs() > bound).any())
    once = silu_mul(x.to(device)).cpu().double()
    assert bool(((once - expected).abs() <= bound).all())


def test_silu_mul_three_dim_and_empty(device: torch.device) -> None:
    x = silu_case(6, 96, torch.float32, seed=6)
    out = silu_mul(x.view(2, 3, 192).to(device)).cpu()
    assert out.shape == (2, 3, 96)
    expected = silu_oracle(x).view(2, 3, 96)
    assert bool(((out.double() - expected).abs() <= silu_bound(expected, torch.float32)).all())
    assert silu_mul(x[:0].to(device)).shape == (0, 96)
    with pytest.raises(ValueError, match="even"):
        silu_mul(x[:, :191].to(device))


def test_unit_roundoffs_are_the_dtypes() -> None:
    for dtype, u in UNIT_ROUNDOFF.items():
        assert u == torch.finfo(dtype).eps / 2
    assert math.isclose(subnormal_slack(torch.float16), 2.0**-25)
