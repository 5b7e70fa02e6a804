"""Activation quantization to FP8 (e4m3) or INT8, alone or fused with the op that produces the activations.

Conventions (DESIGN.md): `x = scale * (q - azp)`; FP8 saturates at +-448; symmetric INT8 uses [-127, 127];
asymmetric INT8 uses [-128, 127] with an integer zero point. Dynamic scales are per token (one per row):
- FP8: `s = max(absmax / 448, SCALE_FLOOR)`; INT8 symmetric: `s = max(absmax / 127, SCALE_FLOOR)`.
- INT8 asymmetric: the row range is widened to include 0 (so 0 is exact and the zero point always fits
  in int8), `s = max((hi - lo) / 255, SCALE_FLOOR)`, `azp = rint(-128 - lo / s)`.
Rounding is to nearest even everywhere. The floor only guards all-zero rows against 0/0.

Producers fused in front of the quantizer, so the activations are read once and never written in 16 bits:
RMSNorm (optionally after a residual add, whose sum is written back as the new residual; optionally Gemma's
`1 + weight`), gated `act(gate) * up` on a `[M, 2*I]` input (gate first) and plain `act(x)`, for the
activations of `kernels/activation.py` (SiLU, GELU, GELU-tanh). All math is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels import activation as _activation
from kestrel.kernels import common
from kestrel.kernels.quant_types import QuantAct

FP8_MAX = 448.0
SCALE_FLOOR = 1e-12

_IDENTITY, _RMS, _RMS_RESIDUAL, _ACT_MUL, _ACT = 0, 1, 2, 3, 4
_FP8, _INT8_SYM, _INT8_ASYM = 0, 1, 2
_MAX_ONE_PASS = 16384  # longest row held in registers (8 warps x 32 lanes x 64 values)
_LOOP_BLOCK = 4096


# ----------------------------------------------------------------------------------------- public API


def quant_fp8_per_token(x: torch.Tensor) -> QuantAct:
    return _launch(x, _IDENTITY, torch.float8_e4m3fn, True, None, None)


def quant_int8_per_token(x: torch.Tensor, symmetric: bool = True) -> QuantAct:
    return _launch(x, _IDENTITY, torch.int8, symmetric, None, None)


def quant_static(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                 azp: torch.Tensor | None = None) -> QuantAct:
    """Per-tensor quantization with a given fp32 scale (and int32 zero point for asymmetric INT8)."""
    return _launch(x, _IDENTITY, dtype, azp is None, scale, azp)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype,
                   residual: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                   azp: torch.Tensor | None = None, symmetric: bool = True,
                   unit_offset: bool = False) -> tuple[QuantAct, torch.Tensor | None]:
    """RMSNorm(x [+ residual]) * weight (`* (1 + weight)` with `unit_offset`), quantized; returns
    (quantized, new residual or None).

    With a residual, `h = x + residual` is rounded to x's dtype (that is the new residual) and normalized.
    A given `scale` (and `azp`) means static per-tensor quantization, otherwise dynamic per token.
    """
    producer = _RMS if residual is None else _RMS_RESIDUAL
    sym = symmetric if scale is None else azp is None
    return _launch(x, producer, dtype, sym, scale, azp, weight=weight, eps=eps, residual=residual,
                   with_residual=True, unit_offset=unit_offset)


def act_mul_quant(x: torch.Tensor, activation: str, dtype: torch.dtype, scale: torch.Tensor | None = None,
                  azp: torch.Tensor | None = None, symmetric: bool = True) -> QuantAct:
    """act(x[:, :I]) * x[:, I:] for x `[M, 2*I]`, quantized (static if `scale` is given)."""
    sym = symmetric if scale is None else azp is None
    return _launch(x, _ACT_MUL, dtype, sym, scale, azp, activation=_activation.activation_code(activation))


def act_quant(x: torch.Tensor, activation: str, dtype: torch.dtype, scale: torch.Tensor | None = None,
              azp: torch.Tensor | None = None, symmetric: bool = True) -> QuantAct:
    """act(x), quantized (static if `scale` is given)."""
    sym = symmetric if scale is None else azp is None
    return _launch(x, _ACT, dtype, sym, scale, azp, activation=_activation.activation_code(activation))


def silu_mul_quant(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None,
                   azp: torch.Tensor | None = None, symmetric: bool = True) -> QuantAct:
    """SiLU(x[:, :I]) * x[:, I:] for x `[M, 2*I]`, quantized (static if `scale` is given)."""
    return act_mul_quant(x, "silu", dtype, scale, azp, symmetric)


# ------------------------------------------------------------------------------------------ references


def quant_fp8_per_token_ref(x: torch.Tensor) -> QuantAct:
    return _quantize_ref(x.float(), torch.float8_e4m3fn, True, None, None)


def quant_int8_per_token_ref(x: torch.Tensor, symmetric: bool = True) -> QuantAct:
    return _quantize_ref(x.float(), torch.int8, symmetric, None, None)


def quant_static_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                     azp: torch.Tensor | None = None) -> QuantAct:
    return _quantize_ref(x.float(), dtype, azp is None, scale, azp)


def rms_norm_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype,
                       residual: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                       azp: torch.Tensor | None = None, symmetric: bool = True,
                       unit_offset: bool = False) -> tuple[QuantAct, torch.Tensor | None]:
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    rstd = 1.0 / torch.sqrt((hf * hf).sum(dim=-1, keepdim=True) / hf.shape[-1] + eps)
    y = hf * rstd * (1.0 + weight.float() if unit_offset else weight.float())
    sym = symmetric if scale is None else azp is None
    return _quantize_ref(y, dtype, sym, scale, azp), (None if residual is None else h)


def act_mul_quant_ref(x: torch.Tensor, activation: str, dtype: torch.dtype, scale: torch.Tensor | None = None,
                      azp: torch.Tensor | None = None, symmetric: bool = True) -> QuantAct:
    inter = x.shape[-1] // 2
    g, u = x[..., :inter].float(), x[..., inter:].float()
    y = _activation.activate_as_kernels_ref(g, activation) * u
    sym = symmetric if scale is None else azp is None
    return _quantize_ref(y, dtype, sym, scale, azp)


def act_quant_ref(x: torch.Tensor, activation: str, dtype: torch.dtype, scale: torch.Tensor | None = None,
                  azp: torch.Tensor | None = None, symmetric: bool = True) -> QuantAct:
    y = _activation.activate_as_kernels_ref(x.float(), activation)
    sym = symmetric if scale is None else azp is None
    return _quantize_ref(y, dtype, sym, scale, azp)


def silu_mul_quant_ref(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None,
                       azp: torch.Tensor | None = None, symmetric: bool = True) -> QuantAct:
    return act_mul_quant_ref(x, "silu", dtype, scale, azp, symmetric)


def _quantize_ref(y: torch.Tensor, dtype: torch.dtype, symmetric: bool, scale: torch.Tensor | None,
                  azp: torch.Tensor | None) -> QuantAct:
    _check_mode(dtype, symmetric)
    zp = None
    if scale is None:
        if dtype == torch.int8 and not symmetric:
            hi = y.amax(dim=-1, keepdim=True).clamp(min=0.0)
            lo = y.amin(dim=-1, keepdim=True).clamp(max=0.0)
            s = ((hi - lo) / 255.0).clamp(min=SCALE_FLOOR)
            zp = torch.round(-128.0 - lo / s)
        else:
            qmax = FP8_MAX if dtype == torch.float8_e4m3fn else 127.0
            s = (y.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=SCALE_FLOOR)
    else:
        s = scale.float().reshape(1, 1)
        zp = None if azp is None else azp.float().reshape(1, 1)
    v = y * (1.0 / s)  # the kernels multiply by the fp32 reciprocal too
    if dtype == torch.float8_e4m3fn:
        q = v.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    elif zp is None:
        q = torch.round(v).clamp(-127, 127).to(dtype)
    else:
        q = (torch.round(v) + zp).clamp(-128, 127).to(dtype)
    if scale is not None:
        return QuantAct(q, scale, azp)
    return QuantAct(q, s, None if zp is None else zp.reshape(-1).to(torch.int32))


def _check_mode(dtype: torch.dtype, symmetric: bool) -> None:
    if dtype not in (torch.float8_e4m3fn, torch.int8):
        raise ValueError(f"activation quantization targets float8_e4m3fn or int8, not {dtype}")
    if dtype == torch.float8_e4m3fn and not symmetric:
        raise ValueError("FP8 activation quantization is symmetric only")


# ---------------------------------------------------------------------------------------------- kernel


@triton.jit
def _produce(x_row, r_row, w_ptr, offs, mask, K, rstd, PRODUCER: tl.constexpr, ACTIVATION: tl.constexpr,
             UNIT_OFFSET: tl.constexpr, FAST: tl.constexpr):
    """The fp32 activations of one chunk of a row (0 where masked: every activation maps 0 to 0)."""
    if PRODUCER == 3:
        g = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_row + K + offs, mask=mask, other=0.0).to(tl.float32)
        y = _activation.activate(g, ACTIVATION) * u
    elif PRODUCER == 4:
        y = _activation.activate(tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32), ACTIVATION)
    else:
        y = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if PRODUCER == 2:
            r = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
            y = common.to_dtype(y + r, x_row.dtype.element_ty, FAST).to(tl.float32)
        if PRODUCER >= 1:
            w = _norm_weight(w_ptr, offs, mask, UNIT_OFFSET)
            y = y * rstd * w
    return y


@triton.jit
def _norm_weight(w_ptr, offs, mask, UNIT_OFFSET: tl.constexpr):
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w = 1.0 + w
    return w


@triton.jit
def _row_scale(row_hi, row_lo, QMODE: tl.constexpr):
    """Per-row scale and zero point from the row's range (which includes 0)."""
    z = 0.0
    if QMODE == 0:
        s = tl.maximum(tl.math.div_rn(tl.maximum(row_hi, -row_lo), 448.0), 1e-12)
    elif QMODE == 1:
        s = tl.maximum(tl.math.div_rn(tl.maximum(row_hi, -row_lo), 127.0), 1e-12)
    else:
        s = tl.maximum(tl.math.div_rn(row_hi - row_lo, 255.0), 1e-12)
        z = common.rint(-128.0 - tl.math.div_rn(row_lo, s))
    return s, z


@triton.jit
def _quantize(y, inv_s, z, q_dtype: tl.constexpr, QMODE: tl.constexpr, FAST: tl.constexpr):
    """y * (1/s) (+ z) rounded to nearest even and saturated, as `q_dtype`. On the GPU the hardware
    conversions round (cvt.rn.satfinite to e4m3, cvt.rni); the interpreter gets exact manual rounding."""
    v = y * inv_s
    if QMODE == 0:
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        if not FAST:
            v = common.round_e4m3(v)
        q = v.to(q_dtype)
    else:
        r = libdevice.rint(v) if FAST else common.rint(v)
        if QMODE == 1:
            q = tl.minimum(tl.maximum(r, -127.0), 127.0).to(q_dtype)
        else:
            q = tl.minimum(tl.maximum(r + z, -128.0), 127.0).to(q_dtype)
    return q


@triton.jit
def _rstd(sumsq, K, eps):
    return tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(sumsq, axis=0), K * 1.0) + eps))


@triton.jit
def _act_quant_kernel(x_ptr, r_ptr, w_ptr, ro_ptr, q_ptr, s_ptr, z_ptr, s_in_ptr, z_in_ptr,
                      K, stride_x, stride_r, stride_ro, stride_q, eps,
                      PRODUCER: tl.constexpr, QMODE: tl.constexpr, STATIC: tl.constexpr,
                      ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr, FAST: tl.constexpr,
                      BLOCK: tl.constexpr, ACTIVATION: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    ro_row = ro_ptr + row * stride_ro
    q_row = q_ptr + row * stride_q
    arange = tl.arange(0, BLOCK)
    z = 0.0
    if ONE_PASS:
        # The whole row fits one block: read it once, keep it in registers.
        mask = arange < K
        if PRODUCER >= 3:
            y = _produce(x_row, r_row, w_ptr, arange, mask, K, 1.0, PRODUCER, ACTIVATION, UNIT_OFFSET, FAST)
        else:
            y = tl.load(x_row + arange, mask=mask, other=0.0).to(tl.float32)
            if PRODUCER == 2:
                r = tl.load(r_row + arange, mask=mask, other=0.0).to(tl.float32)
                h = common.to_dtype(y + r, x_row.dtype.element_ty, FAST)
                tl.store(ro_row + arange, h, mask=mask)
                y = h.to(tl.float32)
            if PRODUCER >= 1:
                w = _norm_weight(w_ptr, arange, mask, UNIT_OFFSET)
                y = y * _rstd(y * y, K, eps) * w
        if STATIC:
            s = tl.load(s_in_ptr)
            if QMODE == 2:
                z = tl.load(z_in_ptr).to(tl.float32)
        else:
            s, z = _row_scale(tl.max(tl.maximum(y, 0.0), axis=0), tl.min(tl.minimum(y, 0.0), axis=0), QMODE)
            tl.store(s_ptr + row, s)
            if QMODE == 2:
                tl.store(z_ptr + row, z.to(tl.int32))
        tl.store(q_row + arange, _quantize(y, tl.math.div_rn(1.0, s), z, q_ptr.dtype.element_ty, QMODE, FAST),
                 mask=mask)
    else:
        # Long rows: a statistics pass (two for RMSNorm) over L2-resident chunks, then the quantizing pass.
        rstd = 1.0
        if PRODUCER == 1 or PRODUCER == 2:
            sumsq = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                offs = k0 + arange
                h = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
                if PRODUCER == 2:
                    r = tl.load(r_row + offs, mask=offs < K, other=0.0).to(tl.float32)
                    h = common.to_dtype(h + r, x_row.dtype.element_ty, FAST)
                    tl.store(ro_row + offs, h, mask=offs < K)
                    h = h.to(tl.float32)
                sumsq += h * h
            rstd = _rstd(sumsq, K, eps)
        if STATIC:
            s = tl.load(s_in_ptr)
            if QMODE == 2:
                z = tl.load(z_in_ptr).to(tl.float32)
        else:
            hi = tl.zeros((BLOCK,), dtype=tl.float32)
            lo = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                offs = k0 + arange
                y = _produce(x_row, r_row, w_ptr, offs, offs < K, K, rstd, PRODUCER, ACTIVATION, UNIT_OFFSET, FAST)
                hi = tl.maximum(hi, y)
                lo = tl.minimum(lo, y)
            s, z = _row_scale(tl.max(hi, axis=0), tl.min(lo, axis=0), QMODE)
            tl.store(s_ptr + row, s)
            if QMODE == 2:
                tl.store(z_ptr + row, z.to(tl.int32))
        inv_s = tl.math.div_rn(1.0, s)
        for k0 in range(0, K, BLOCK):
            offs = k0 + arange
            y = _produce(x_row, r_row, w_ptr, offs, offs < K, K, rstd, PRODUCER, ACTIVATION, UNIT_OFFSET, FAST)
            tl.store(q_row + offs, _quantize(y, inv_s, z, q_ptr.dtype.element_ty, QMODE, FAST), mask=offs < K)


def _launch_options(x: torch.Tensor, block: int) -> dict:
    # 8 warps hold a 16,384-wide row at 64 values a thread. Measured on an H100 at 8,192 rows, SiLU-and-multiply of
    # 14,336: 8 warps 252 us, 16 warps 312 us, 4 warps 409 us (they spill); 8 no slower at 1 and 64 rows.
    return {"num_warps": 4 if block <= 2048 else 8, **common.launch_options(x)}


def _launch(x: torch.Tensor, producer: int, dtype: torch.dtype, symmetric: bool,
            scale: torch.Tensor | None, azp: torch.Tensor | None, *, weight: torch.Tensor | None = None,
            eps: float = 0.0, residual: torch.Tensor | None = None, with_residual: bool = False,
            activation: int = 0, unit_offset: bool = False):
    _check_mode(dtype, symmetric)
    width = x.shape[-1]
    if producer == _ACT_MUL and width % 2:
        raise ValueError(f"act_mul_quant needs an even last dimension (gate then up), got {width}")
    K = width // 2 if producer == _ACT_MUL else width
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    q = torch.empty((M, K), dtype=dtype, device=x.device)
    static = scale is not None
    s_out = torch.empty((M, 1), dtype=torch.float32, device=x.device) if not static else q
    asym = dtype == torch.int8 and not symmetric
    z_out = torch.empty((M,), dtype=torch.int32, device=x.device) if asym and not static else q
    r2 = residual.reshape(-1, width).contiguous() if residual is not None else x2
    r_out = torch.empty_like(x2) if residual is not None else x2
    if M > 0:
        one_pass = K <= _MAX_ONE_PASS
        block = triton.next_power_of_2(max(K, 1)) if one_pass else _LOOP_BLOCK
        qmode = _FP8 if dtype == torch.float8_e4m3fn else (_INT8_ASYM if asym else _INT8_SYM)
        s_in = scale.reshape(-1).float().contiguous() if static else s_out
        z_in = azp.reshape(-1).to(torch.int32).contiguous() if (static and azp is not None) else s_in
        _act_quant_kernel[(M,)](
            x2, r2, weight if weight is not None else x2, r_out, q, s_out, z_out, s_in, z_in,
            K, x2.stride(0), r2.stride(0), r_out.stride(0), q.stride(0), float(eps),
            PRODUCER=producer, QMODE=qmode, STATIC=static, ONE_PASS=one_pass, BLOCK=block,
            ACTIVATION=activation, UNIT_OFFSET=unit_offset, **_launch_options(x, block),
        )
    q = q.reshape(*x.shape[:-1], K)
    if static:
        result = QuantAct(q, scale, azp)
    else:
        result = QuantAct(q, s_out, z_out if asym else None)
    if with_residual:
        return result, (r_out.reshape(x.shape) if residual is not None else None)
    return result
