"""Activation quantization: Triton kernels (interpreted on CPU) vs their references vs a float64 oracle.

Kernel vs reference: bit for bit where both do the same IEEE operations in the same order (plain
quantization), within one rounding step where a reduction order or exp differs (RMSNorm, SiLU).
Both vs the float64 oracle (numpy, nearest-even onto the e4m3 / int8 grids): within one rounding step.
Special rows: all zeros, a saturating outlier, a constant row, an all-negative row, a denormal-tiny row.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kestrel.kernels import quant_act as qa

FLOOR = qa.SCALE_FLOOR


# --------------------------------------------------------------------------------------------- oracle


def _e4m3_grid() -> tuple[np.ndarray, np.ndarray]:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    values = codes.float().numpy().astype(np.float64)
    keep = np.isfinite(values) & ~((values == 0) & (np.arange(256) >= 128))  # drop NaNs and -0
    order = np.argsort(values[keep])
    return values[keep][order], np.arange(256)[keep][order]


GRID, GRID_CODES = _e4m3_grid()


def round_e4m3(v: np.ndarray) -> np.ndarray:
    """Nearest e4m3 value, ties to the even code (even mantissa), saturating at +-448."""
    v = np.clip(v, -448.0, 448.0)
    hi = np.clip(np.searchsorted(GRID, v), 1, len(GRID) - 1)
    lo = hi - 1
    d_lo, d_hi = v - GRID[lo], GRID[hi] - v
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (GRID_CODES[hi] % 2 == 0))
    return np.where(pick_hi, GRID[hi], GRID[lo])


def oracle_quant(y: np.ndarray, dtype: torch.dtype, symmetric: bool, scale=None, azp=None):
    """float64: returns (q values, scale per row, zero point per row or None)."""
    z = None
    if scale is None:
        if dtype == torch.int8 and not symmetric:
            hi, lo = np.maximum(y.max(axis=1), 0.0), np.minimum(y.min(axis=1), 0.0)
            s = np.maximum((hi - lo) / 255.0, FLOOR)
            z = np.rint(-128.0 - lo / s)
        else:
            s = np.maximum(np.abs(y).max(axis=1) / (448.0 if dtype == torch.float8_e4m3fn else 127.0), FLOOR)
    else:
        s = np.full(y.shape[0], float(scale))
        z = None if azp is None else np.full(y.shape[0], float(azp))
    v = y / s[:, None]
    if dtype == torch.float8_e4m3fn:
        q = round_e4m3(v)
    elif z is None:
        q = np.clip(np.rint(v), -127, 127)
    else:
        q = np.clip(np.rint(v) + z[:, None], -128, 127)
    return q, s, z


def oracle_rms(x, w, eps, residual=None):
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)  # rounding to x's dtype
    hd = h.double().numpy()
    y = hd / np.sqrt((hd * hd).mean(axis=1, keepdims=True) + eps) * w.double().numpy()
    return y, h


def oracle_silu(x):
    xd = x.double().numpy()
    inter = xd.shape[1] // 2
    g, u = xd[:, :inter], xd[:, inter:]
    return g / (1.0 + np.exp(-g)) * u


# ---------------------------------------------------------------------------------------- comparisons


def steps(q: torch.Tensor) -> np.ndarray:
    """Position on the quantization grid: int8 value, or signed e4m3 magnitude code (+0 == -0)."""
    if q.dtype == torch.int8:
        return q.cpu().numpy().astype(np.int64)
    bits = q.cpu().view(torch.uint8).numpy().astype(np.int64)
    return np.where(bits >= 128, -(bits - 128), bits)


def grid_steps(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    if dtype == torch.int8:
        return values.astype(np.int64)
    return steps(torch.from_numpy(values.astype(np.float32)).to(torch.float8_e4m3fn))


def assert_within_one_step(q: torch.Tensor, expected: np.ndarray) -> None:
    diff = np.abs(steps(q) - grid_steps(expected, q.dtype))
    assert diff.max() <= 1, f"{(diff > 1).sum()} elements more than one step off"


def assert_same(a: qa.QuantAct, b: qa.QuantAct, exact: bool) -> None:
    assert a.q.dtype == b.q.dtype and a.q.shape == b.q.shape
    if exact:
        assert np.array_equal(steps(a.q), steps(b.q))
        assert torch.equal(a.scale.cpu(), b.scale.cpu())
    else:
        assert np.abs(steps(a.q) - steps(b.q)).max() <= 1
        torch.testing.assert_close(a.scale.cpu(), b.scale.cpu(), rtol=1e-5, atol=0)
    if a.azp is None:
        assert b.azp is None
    else:
        assert (a.azp.cpu() - b.azp.cpu()).abs().max() <= (0 if exact else 1)


def assert_oracle(res: qa.QuantAct, y: np.ndarray, dtype, symmetric, scale=None, azp=None) -> None:
    q, s, z = oracle_quant(y, dtype, symmetric, scale, azp)
    if scale is None:
        np.testing.assert_allclose(res.scale.cpu().double().numpy().reshape(-1), s, rtol=1e-6)
        if z is not None:
            assert np.abs(res.azp.cpu().numpy() - z).max() <= 1
    assert_within_one_step(res.q, q)


# ---------------------------------------------------------------------------------------------- inputs


def activations(M: int, K: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 3
    x[0] = 0.0  # all-zero row: the scale floor
    if M > 1:
        x[1, K // 3] = 3e4  # an outlier owns its row's scale
    if M > 2:
        x[2] = 0.75  # constant row
    if M > 3:
        x[3] = -x[3].abs() - 0.1  # all negative (asymmetric zero point at its top)
    if M > 4:
        x[4] = 1e-30  # tiny: below fp16/bf16 normals, flushed or kept, never NaN
    return x.to(dtype)


MODES = [(torch.float8_e4m3fn, True), (torch.int8, True), (torch.int8, False)]
X_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(7, 300), (3, 4100)]  # a row shorter than one block, and a row spanning two blocks


def _dynamic(x, dtype, symmetric, ref=False):
    if dtype == torch.float8_e4m3fn:
        return (qa.quant_fp8_per_token_ref if ref else qa.quant_fp8_per_token)(x)
    return (qa.quant_int8_per_token_ref if ref else qa.quant_int8_per_token)(x, symmetric)


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_dynamic_per_token(mode, x_dtype, shape, device):
    dtype, symmetric = mode
    x = activations(*shape, x_dtype)
    got = _dynamic(x.to(device), dtype, symmetric)
    ref = _dynamic(x, dtype, symmetric, ref=True)
    assert got.scale.shape == (shape[0], 1) and got.scale.dtype == torch.float32
    assert_same(got, ref, exact=True)
    y = x.double().numpy()
    assert_oracle(got, y, dtype, symmetric)
    assert_oracle(ref, y, dtype, symmetric)
    assert float(got.scale[0]) == float(np.float32(FLOOR))
    zero = 0 if got.azp is None else int(got.azp[0])
    assert (got.q[0].cpu().float() == zero).all()  # the all-zero row dequantizes to exact zeros


@pytest.mark.parametrize("mode", MODES)
def test_dequantization_error_is_half_a_step(mode, device):
    dtype, symmetric = mode
    x = activations(9, 257, torch.float32, seed=1)
    res = _dynamic(x.to(device), dtype, symmetric)
    q = res.q.cpu().float().double()
    z = 0.0 if res.azp is None else res.azp.cpu().double().reshape(-1, 1)
    s = res.scale.cpu().double()
    err = (s * (q - z) - x.double()).abs()
    if dtype == torch.int8:
        assert (err <= s / 2 * (1 + 1e-5) + 1e-30).all()
    else:
        assert (err <= x.double().abs() * 2.0**-4 + s * 2.0**-10).all()  # 3 mantissa bits, subnormal step


@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("mode", [(torch.float8_e4m3fn, None), (torch.int8, None), (torch.int8, 5)])
def test_static_per_tensor_saturates(mode, x_dtype, device):
    dtype, zero_point = mode
    x = activations(6, 130, x_dtype, seed=2)
    scale = torch.tensor(0.02)  # small: the outlier and the large values saturate
    azp = None if zero_point is None else torch.tensor(zero_point, dtype=torch.int32)
    dev = lambda t: None if t is None else t.to(device)
    got = qa.quant_static(x.to(device), dev(scale), dtype, dev(azp))
    ref = qa.quant_static_ref(x, scale, dtype, azp)
    assert_same(got, ref, exact=True)
    assert_oracle(got, x.double().numpy(), dtype, True, 0.02, zero_point)
    top = 448.0 if dtype == torch.float8_e4m3fn else 127.0
    assert float(got.q.float().max()) == top


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_rms_norm_quant(mode, with_residual, shape, device):
    dtype, symmetric = mode
    M, K = shape
    g = torch.Generator().manual_seed(3)
    x = activations(M, K, torch.bfloat16, seed=4)
    w = (torch.rand(K, generator=g) + 0.5).to(torch.bfloat16)
    residual = (torch.randn(M, K, generator=g)).to(torch.bfloat16) if with_residual else None
    dev = lambda t: None if t is None else t.to(device)
    got, got_res = qa.rms_norm_quant(dev(x), dev(w), 1e-6, dtype, dev(residual), symmetric=symmetric)
    ref, ref_res = qa.rms_norm_quant_ref(x, w, 1e-6, dtype, residual, symmetric=symmetric)
    assert_same(got, ref, exact=False)
    y, h = oracle_rms(x, w, 1e-6, residual)
    assert_oracle(got, y, dtype, symmetric)
    assert_oracle(ref, y, dtype, symmetric)
    if with_residual:
        assert torch.equal(got_res.cpu(), h) and torch.equal(ref_res, h)
    else:
        assert got_res is None and ref_res is None


def test_rms_norm_quant_static_fp16(device):
    x = activations(5, 96, torch.float16, seed=5)
    w = torch.full((96,), 1.5, dtype=torch.float16)
    r = torch.randn(5, 96).to(torch.float16)
    scale = torch.tensor(0.01)
    got, got_res = qa.rms_norm_quant(x.to(device), w.to(device), 1e-5, torch.int8, r.to(device), scale.to(device))
    ref, ref_res = qa.rms_norm_quant_ref(x, w, 1e-5, torch.int8, r, scale)
    assert_same(got, ref, exact=False)
    assert torch.equal(got_res.cpu(), ref_res)
    y, _ = oracle_rms(x, w, 1e-5, r)
    assert_oracle(got, y, torch.int8, True, 0.01)


@pytest.mark.parametrize("inter", [150, 2100])
@pytest.mark.parametrize("mode", MODES)
def test_silu_mul_quant(mode, inter, device):
    dtype, symmetric = mode
    x = activations(6, 2 * inter, torch.bfloat16, seed=6)
    got = qa.silu_mul_quant(x.to(device), dtype, symmetric=symmetric)
    ref = qa.silu_mul_quant_ref(x, dtype, symmetric=symmetric)
    assert got.q.shape == (6, inter)
    assert_same(got, ref, exact=False)
    y = oracle_silu(x)
    assert_oracle(got, y, dtype, symmetric)
    assert_oracle(ref, y, dtype, symmetric)


def test_silu_mul_quant_static(device):
    x = activations(4, 64, torch.float32, seed=7)
    scale = torch.tensor(0.05)
    got = qa.silu_mul_quant(x.to(device), torch.float8_e4m3fn, scale.to(device))
    ref = qa.silu_mul_quant_ref(x, torch.float8_e4m3fn, scale)
    assert_same(got, ref, exact=False)
    assert_oracle(got, oracle_silu(x), torch.float8_e4m3fn, True, 0.05)


@pytest.mark.parametrize("mode", MODES)
def test_looped_path_for_long_rows(mode, device, monkeypatch):
    """Rows longer than one register block take the chunked path (forced here with tiny limits)."""
    monkeypatch.setattr(qa, "_MAX_ONE_PASS", 64)
    monkeypatch.setattr(qa, "_LOOP_BLOCK", 128)
    dtype, symmetric = mode
    x = activations(5, 300, torch.bfloat16, seed=8)
    assert_same(_dynamic(x.to(device), dtype, symmetric), _dynamic(x, dtype, symmetric, ref=True), exact=True)
    w = (torch.rand(300) + 0.5).to(torch.bfloat16)
    r = torch.randn(5, 300).to(torch.bfloat16)
    got, got_res = qa.rms_norm_quant(x.to(device), w.to(device), 1e-6, dtype, r.to(device), symmetric=symmetric)
    ref, ref_res = qa.rms_norm_quant_ref(x, w, 1e-6, dtype, r, symmetric=symmetric)
    assert_same(got, ref, exact=False)
    assert torch.equal(got_res.cpu(), ref_res)
    g = activations(5, 600, torch.bfloat16, seed=9)
    assert_same(qa.silu_mul_quant(g.to(device), dtype, symmetric=symmetric),
                qa.silu_mul_quant_ref(g, dtype, symmetric=symmetric), exact=False)
    static = qa.quant_static(x.to(device), torch.tensor(0.02, device=device), dtype)
    assert_same(static, qa.quant_static_ref(x, torch.tensor(0.02), dtype), exact=True)


def test_leading_dims_and_empty(device):
    x = activations(6, 40, torch.bfloat16).reshape(2, 3, 40)
    got = qa.quant_int8_per_token(x.to(device), symmetric=False)
    ref = qa.quant_int8_per_token_ref(x.reshape(6, 40), symmetric=False)
    assert got.q.shape == (2, 3, 40) and got.scale.shape == (6, 1) and got.azp.shape == (6,)
    assert torch.equal(got.q.reshape(6, 40).cpu(), ref.q)
    empty = qa.quant_fp8_per_token(torch.zeros(0, 40, dtype=torch.bfloat16, device=device))
    assert empty.q.shape == (0, 40) and empty.scale.shape == (0, 1)


def test_fp8_asymmetric_is_refused():
    with pytest.raises(ValueError):
        qa.silu_mul_quant_ref(torch.zeros(2, 8), torch.float8_e4m3fn, symmetric=False)


def test_kernels_really_run_in_the_interpreter():
    if torch.cuda.is_available():
        pytest.skip("compiled kernels on a GPU machine")
    assert type(qa._act_quant_kernel).__name__ == "InterpretedFunction"


# ------------------------------------------------------------------------- GELU producers, Gemma norm


def oracle_act(g: np.ndarray, activation: str) -> np.ndarray:
    """float64 HF formulas: exact (erf) GELU and the tanh approximation."""
    if activation == "gelu":
        return 0.5 * g * (1.0 + np.vectorize(math.erf)(g / math.sqrt(2.0)))
    return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))


def oracle_act_mul(x, activation):
    xd = x.double().numpy()
    inter = xd.shape[1] // 2
    return oracle_act(xd[:, :inter], activation) * xd[:, inter:]


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("mode", MODES)
def test_gelu_mul_quant(mode, activation, device):
    dtype, symmetric = mode
    x = activations(6, 2 * 150, torch.bfloat16, seed=10)
    got = qa.act_mul_quant(x.to(device), activation, dtype, symmetric=symmetric)
    ref = qa.act_mul_quant_ref(x, activation, dtype, symmetric=symmetric)
    assert got.q.shape == (6, 150)
    assert_same(got, ref, exact=False)
    y = oracle_act_mul(x, activation)
    assert_oracle(got, y, dtype, symmetric)
    assert_oracle(ref, y, dtype, symmetric)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_plain_act_quant_and_static(activation, device):
    """Non-gated act(x) -> quant (GPT-NeoX / Phi-2 MLPs), dynamic asymmetric INT8 and static FP8."""
    x = activations(5, 200, torch.float16, seed=11)
    y = oracle_act(x.double().numpy(), activation)
    got = qa.act_quant(x.to(device), activation, torch.int8, symmetric=False)
    assert_same(got, qa.act_quant_ref(x, activation, torch.int8, symmetric=False), exact=False)
    assert_oracle(got, y, torch.int8, False)
    scale = torch.tensor(0.03)
    got = qa.act_quant(x.to(device), activation, torch.float8_e4m3fn, scale.to(device))
    assert_same(got, qa.act_quant_ref(x, activation, torch.float8_e4m3fn, scale), exact=False)
    assert_oracle(got, y, torch.float8_e4m3fn, True, 0.03)


def test_gelu_quant_looped_path(device, monkeypatch):
    monkeypatch.setattr(qa, "_MAX_ONE_PASS", 64)
    monkeypatch.setattr(qa, "_LOOP_BLOCK", 128)
    x = activations(4, 2 * 300, torch.bfloat16, seed=12)
    got = qa.act_mul_quant(x.to(device), "gelu_tanh", torch.float8_e4m3fn)
    assert_same(got, qa.act_mul_quant_ref(x, "gelu_tanh", torch.float8_e4m3fn), exact=False)
    assert_oracle(got, oracle_act_mul(x, "gelu_tanh"), torch.float8_e4m3fn, True)
    w = (torch.rand(600) - 0.5).to(torch.bfloat16)
    got, _ = qa.rms_norm_quant(x.to(device), w.to(device), 1e-6, torch.int8, unit_offset=True)
    ref, _ = qa.rms_norm_quant_ref(x, w, 1e-6, torch.int8, unit_offset=True)
    assert_same(got, ref, exact=False)
    assert_oracle(got, oracle_rms(x, 1.0 + w.double(), 1e-6)[0], torch.int8, True)


def test_silu_mul_quant_is_act_mul_quant_silu(device):
    x = activations(4, 2 * 64, torch.bfloat16, seed=13).to(device)
    a, b = qa.silu_mul_quant(x, torch.int8), qa.act_mul_quant(x, "silu", torch.int8)
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)
    a, b = qa.silu_mul_quant_ref(x.cpu(), torch.int8), qa.act_mul_quant_ref(x.cpu(), "silu", torch.int8)
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_unit_offset_rms_norm_quant(mode, with_residual, device):
    """Gemma's `norm(h) * (1 + weight)` feeding the quantizer; weights around 0 as Gemma stores them."""
    dtype, symmetric = mode
    g = torch.Generator().manual_seed(14)
    x = activations(7, 300, torch.bfloat16, seed=15)
    w = (torch.randn(300, generator=g) * 0.5).to(torch.bfloat16)
    residual = torch.randn(7, 300, generator=g).to(torch.bfloat16) if with_residual else None
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    got, got_res = qa.rms_norm_quant(dev(x), dev(w), 1e-6, dtype, dev(residual), symmetric=symmetric,
                                     unit_offset=True)
    ref, ref_res = qa.rms_norm_quant_ref(x, w, 1e-6, dtype, residual, symmetric=symmetric, unit_offset=True)
    assert_same(got, ref, exact=False)
    y, h = oracle_rms(x, 1.0 + w.double(), 1e-6, residual)
    assert_oracle(got, y, dtype, symmetric)
    assert_oracle(ref, y, dtype, symmetric)
    if with_residual:
        assert torch.equal(got_res.cpu(), h) and torch.equal(ref_res, h)
