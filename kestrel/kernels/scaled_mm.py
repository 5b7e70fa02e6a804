"""W8A8 GEMM with every scale and correction applied on the accumulator before the single store.

`out[m, n] = scale_a[m] * scale_b[n] * (acc[m, n] - azp[m] * azp_adj[n]) + bias[n]`, computed in fp32 and
rounded once to `out_dtype`, where `acc = a @ b.T` accumulates exactly in int32 (int8) or in fp32 (fp8).

One Triton kernel serves two shape regimes, chosen by a per-(GPU, N, K, M bucket) tuning table:
- small M (decode): operands swapped so the weight rows fill the MMA tile's M side (wgmma needs 64 rows,
  a decode batch has 1-64) and the tokens sit on its narrow N side; split-K when N alone gives too few
  programs to pull the weights at full bandwidth. Split partials meet in a workspace; the last program to
  arrive at a tile (an atomic counter) sums them in a fixed order and runs the epilogue.
- large M (prefill): a persistent grid walking output tiles in grouped order so a group of row tiles
  reuses the same weight columns from L2; TMA descriptors (`tl.make_tensor_descriptor`) feed the tiles.
Scale granularity (per tensor / per row) is a runtime stride (0 or 1), so it costs no extra compile.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels import activation as _activation
from kestrel.kernels import common

SMALL_M = 64
TUNING_DIR = Path(__file__).parent / "tuning"


@dataclass(frozen=True)
class MMConfig:
    """Launch parameters. `block_r` tiles the MMA's row side: tokens, or weight rows when `swap`."""

    swap: bool
    block_r: int
    block_c: int
    block_k: int
    split_k: int = 1
    group: int = 8
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = True
    persistent: bool = False
    flatten: bool = False
    pdl: bool = False  # programmatic dependent launch (Hopper): start while the previous kernel drains
    prefetch: bool = False  # swapped path: pull this program's weight rows into L2 before waiting
    # FP8 on sm_90: the tensor cores accumulate with reduced precision; promote into an fp32 accumulator
    # after every BLOCK_K (as cuBLASLt does unless asked for fast accumulation). Costs registers and FADDs.
    precise_acc: bool = False

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> MMConfig:
        return MMConfig(**d)


# ----------------------------------------------------------------------------------------- reference


def scaled_mm_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    azp_adj: torch.Tensor | None = None,
    azp: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference: exact accumulation in float64, the epilogue in fp32 as the kernel does it."""
    _check_args(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, allow_fp32=True)
    M, N = a.shape[0], b.shape[0]
    acc = a.double() @ b.double().T  # exact for int8: |acc| <= K * 2^14 << 2^53
    if azp is not None:
        acc = acc - azp.double().reshape(-1, 1) * azp_adj.double().reshape(1, N)
    sa = scale_a.float().reshape(-1, 1).expand(M, 1)
    sb = scale_b.float().reshape(1, -1).expand(1, N)
    out = (sa * sb) * acc.float()
    if bias is not None:
        out = out + bias.float().reshape(1, N)
    return out.to(out_dtype)


def _check_args(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, allow_fp32: bool = False) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"scaled_mm: a [M, K] and b [N, K] expected, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"scaled_mm: a and b must both be int8 or float8_e4m3fn, got {a.dtype}, {b.dtype}")
    # The reference also writes float32 (tensor-parallel partial sums of float32 test models).
    if out_dtype not in (torch.bfloat16, torch.float16) and not (allow_fp32 and out_dtype == torch.float32):
        raise ValueError(f"scaled_mm: out_dtype must be bfloat16 or float16, got {out_dtype}")
    M, N = a.shape[0], b.shape[0]
    if scale_a.numel() not in (1, M) or scale_b.numel() not in (1, N):
        raise ValueError("scaled_mm: scale_a must be a scalar or [M, 1], scale_b a scalar or [N, 1]")
    if bias is not None and bias.numel() != N:
        raise ValueError(f"scaled_mm: bias must have N={N} elements")
    if (azp is None) != (azp_adj is None):
        raise ValueError("scaled_mm: azp and azp_adj go together")
    if azp is not None:
        if a.dtype != torch.int8:
            raise ValueError("scaled_mm: zero points are for int8 activations only")
        if azp.numel() not in (1, M) or azp_adj.numel() != N:
            raise ValueError("scaled_mm: azp must be a scalar or [M], azp_adj [N]")


# ------------------------------------------------------------------------------------------- kernel


@triton.jit
def _tile_coords(tile, num_r, num_c, group, split_k):
    """Grouped order: `group` row tiles sweep the column tiles together, sharing them through L2."""
    rc = tile // split_k
    split = tile % split_k
    per_group = group * num_c
    first_r = (rc // per_group) * group
    group_size = tl.minimum(num_r - first_r, group)
    pid_r = first_r + (rc % per_group) % group_size
    pid_c = (rc % per_group) // group_size
    return pid_r, pid_c, split, rc


@triton.jit
def _load_8bit(ptrs, mask, IS_INT8: tl.constexpr):
    """Masked 8-bit load with zero fill; fp8 goes through its bytes (a zero `other` cannot be cast to fp8
    in the interpreter, and the bytes are the same on the GPU)."""
    if IS_INT8:
        v = tl.load(ptrs, mask=mask, other=0)
    else:
        v = tl.load(ptrs.to(tl.pointer_type(tl.uint8)), mask=mask, other=0).to(tl.float8e4nv, bitcast=True)
    return v


@triton.jit
def _prefetch_weight_rows(x_ptr, stride_x, R, K, k_tiles_per_split, num_r, num_c, group, split_k,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Bulk L2 prefetch of the weight bytes this program's first tile reads (8-bit: bytes == elements).
    Weights never depend on the previous kernel, so this may run before `gdc_wait`."""
    pid_r, _, split, _ = _tile_coords(tl.program_id(0), num_r, num_c, group, split_k)
    rows = tl.minimum(pid_r * BLOCK_R + tl.arange(0, BLOCK_R), R - 1)
    k0 = tl.minimum(split * k_tiles_per_split * BLOCK_K, K - 16)
    nbytes = tl.maximum(tl.minimum(k_tiles_per_split * BLOCK_K, K - k0), 16)
    addrs = (x_ptr + rows.to(tl.int64) * stride_x + k0).to(tl.int64)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [addrs, tl.zeros([BLOCK_R], dtype=tl.int32) + nbytes], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def round_bf16(x):
    """fp32 -> nearest-even bf16 grid point, still fp32, for the interpreter, whose casts to bf16
    truncate (the GPU's cast rounds to nearest even by itself)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _epilogue(acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, adj_ptr, azp_ptr, off_r, off_c, M, N, stride_cm,
              stride_sa, stride_sb, stride_azp, SWAP: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_AZP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FAST: tl.constexpr):
    rows = off_r + tl.arange(0, BLOCK_R)
    cols = off_c + tl.arange(0, BLOCK_C)
    if SWAP:
        m_idx = cols[None, :]
        n_idx = rows[:, None]
    else:
        m_idx = rows[:, None]
        n_idx = cols[None, :]
    m_ok = m_idx < M
    n_ok = n_idx < N
    sa = tl.load(sa_ptr + m_idx * stride_sa, mask=m_ok, other=0.0)
    sb = tl.load(sb_ptr + n_idx * stride_sb, mask=n_ok, other=0.0)
    if HAS_AZP:
        azp = tl.load(azp_ptr + m_idx * stride_azp, mask=m_ok, other=0)
        adj = tl.load(adj_ptr + n_idx, mask=n_ok, other=0)
        acc = acc - azp * adj
    out = (sa * sb) * acc.to(tl.float32)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + n_idx, mask=n_ok, other=0.0).to(tl.float32)
    if c_ptr.dtype.element_ty == tl.bfloat16 and not FAST:
        out = round_bf16(out)
    c_ptrs = c_ptr + m_idx.to(tl.int64) * stride_cm + n_idx
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=m_ok & n_ok)


@triton.jit
def _gated_epilogue(acc, acc_up, c_ptr, sa_ptr, sb_ptr, bias_ptr, off_r, off_c, M, N, stride_cm, stride_sa,
                    stride_sb, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr, FAST: tl.constexpr):
    """`act(gate) * up` of the tile's N-wide outputs: gate and up each scaled (and biased) and rounded to the output
    dtype as `_epilogue` writes them, then `activation.act_mul`'s fp32 product rounded once: bit for bit the two
    launches it replaces."""
    rows = off_r + tl.arange(0, BLOCK_R)[:, None]
    cols = off_c + tl.arange(0, BLOCK_C)[None, :]
    m_ok = rows < M
    n_ok = cols < N
    sa = tl.load(sa_ptr + rows * stride_sa, mask=m_ok, other=0.0)
    gate = (sa * tl.load(sb_ptr + cols * stride_sb, mask=n_ok, other=0.0)) * acc.to(tl.float32)
    up = (sa * tl.load(sb_ptr + (N + cols) * stride_sb, mask=n_ok, other=0.0)) * acc_up.to(tl.float32)
    if HAS_BIAS:
        gate = gate + tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)
        up = up + tl.load(bias_ptr + N + cols, mask=n_ok, other=0.0).to(tl.float32)
    dtype: tl.constexpr = c_ptr.dtype.element_ty
    gate = common.to_dtype(gate, dtype, FAST).to(tl.float32)
    up = common.to_dtype(up, dtype, FAST).to(tl.float32)
    out = common.to_dtype(_activation.activate(gate, ACTIVATION) * up, dtype, FAST)
    tl.store(c_ptr + rows.to(tl.int64) * stride_cm + cols, out, mask=m_ok & n_ok)


@triton.jit(do_not_specialize=["M", "stride_sa", "stride_sb", "stride_azp", "num_progs", "group", "split_k"])
def _scaled_mm_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, adj_ptr, azp_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_am, stride_bn, stride_cm, stride_sa, stride_sb, stride_azp,
    num_progs, group, split_k,
    IS_INT8: tl.constexpr, SWAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_AZP: tl.constexpr,
    USE_TMA: tl.constexpr, FLATTEN: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr, PRECISE: tl.constexpr, FAST: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr = False, ACTIVATION: tl.constexpr = 0,
):
    """GATED (`scaled_mm_gated`; not SWAP, not SPLIT): b holds N gate rows then N up rows, each tile accumulates
    the gate columns and the up columns of the same outputs side by side, and the epilogue writes act(gate) * up."""
    ACC: tl.constexpr = tl.int32 if IS_INT8 else tl.float32
    # x supplies the tile rows, y the tile columns; both are [rows, K] with K contiguous (nn.Linear layout).
    if SWAP:
        x_ptr = b_ptr
        y_ptr = a_ptr
        R = N
        C = M
        stride_x = stride_bn
        stride_y = stride_am
    else:
        x_ptr = a_ptr
        y_ptr = b_ptr
        R = M
        C = N
        stride_x = stride_am
        stride_y = stride_bn
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_tiles_per_split = tl.cdiv(k_tiles, split_k)
    num_r = tl.cdiv(R, BLOCK_R)
    num_c = tl.cdiv(C, BLOCK_C)
    if USE_PDL:
        gdc_launch_dependents()
    if PREFETCH:
        _prefetch_weight_rows(x_ptr, stride_x, R, K, k_tiles_per_split, num_r, num_c, group, split_k,
                              BLOCK_R, BLOCK_K)
    if USE_PDL:
        # Everything below reads the previous kernel's output or writes memory it may still read
        # (descriptor scratch, workspace, counters, output).
        gdc_wait()
    if USE_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, [R, K], [stride_x, 1], [BLOCK_R, BLOCK_K])
        y_desc = tl.make_tensor_descriptor(y_ptr, [2 * C if GATED else C, K], [stride_y, 1], [BLOCK_C, BLOCK_K])

    num_tiles = num_r * num_c * split_k
    arange_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, num_progs, flatten=FLATTEN):
        pid_r, pid_c, split, rc = _tile_coords(tile, num_r, num_c, group, split_k)
        off_r = pid_r * BLOCK_R
        off_c = pid_c * BLOCK_C
        kt_begin = split * k_tiles_per_split
        kt_end = tl.minimum(kt_begin + k_tiles_per_split, k_tiles)
        rows = off_r + tl.arange(0, BLOCK_R)
        cols = off_c + tl.arange(0, BLOCK_C)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        y_rows = y_ptr + cols.to(tl.int64)[:, None] * stride_y
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=ACC)
        acc_up = tl.zeros((BLOCK_R, BLOCK_C), dtype=ACC)  # GATED only
        for kt in range(kt_begin, kt_end):
            k = kt * BLOCK_K
            if USE_TMA:
                x = x_desc.load([off_r, k])
                y = y_desc.load([off_c, k])
                if GATED:
                    y_up = y_desc.load([C + off_c, k])
            else:
                k_ok = (k + arange_k)[None, :] < K
                x = _load_8bit(x_rows + (k + arange_k)[None, :], (rows[:, None] < R) & k_ok, IS_INT8)
                y = _load_8bit(y_rows + (k + arange_k)[None, :], (cols[:, None] < C) & k_ok, IS_INT8)
                if GATED:
                    up_rows = y_ptr + (cols + C).to(tl.int64)[:, None] * stride_y
                    y_up = _load_8bit(up_rows + (k + arange_k)[None, :], (cols[:, None] < C) & k_ok, IS_INT8)
            if PRECISE:
                acc = tl.dot(x, y.T, acc, out_dtype=ACC, max_num_imprecise_acc=BLOCK_K)
                if GATED:
                    acc_up = tl.dot(x, y_up.T, acc_up, out_dtype=ACC, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(x, y.T, acc, out_dtype=ACC)
                if GATED:
                    acc_up = tl.dot(x, y_up.T, acc_up, out_dtype=ACC)

        if SPLIT:
            tile_offs = tl.arange(0, BLOCK_R)[:, None] * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
            tile_base = rc.to(tl.int64) * split_k * (BLOCK_R * BLOCK_C)
            tl.store(ws_ptr + tile_base + split * (BLOCK_R * BLOCK_C) + tile_offs, acc)
            tl.debug_barrier()
            arrived = tl.atomic_add(lock_ptr + rc, 1, sem="acq_rel")
            if arrived == split_k - 1:
                # The last arrival sums every partial in split order, so results do not depend on timing.
                total = tl.zeros((BLOCK_R, BLOCK_C), dtype=ACC)
                for s in range(0, split_k):
                    total += tl.load(ws_ptr + tile_base + s * (BLOCK_R * BLOCK_C) + tile_offs,
                                     cache_modifier=".cg")
                tl.atomic_xchg(lock_ptr + rc, 0)
                _epilogue(total, c_ptr, sa_ptr, sb_ptr, bias_ptr, adj_ptr, azp_ptr, off_r, off_c, M, N,
                          stride_cm, stride_sa, stride_sb, stride_azp, SWAP, HAS_BIAS, HAS_AZP,
                          BLOCK_R, BLOCK_C, FAST)
        elif GATED:
            _gated_epilogue(acc, acc_up, c_ptr, sa_ptr, sb_ptr, bias_ptr, off_r, off_c, M, N, stride_cm, stride_sa,
                            stride_sb, HAS_BIAS, ACTIVATION, BLOCK_R, BLOCK_C, FAST)
        else:
            _epilogue(acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, adj_ptr, azp_ptr, off_r, off_c, M, N,
                      stride_cm, stride_sa, stride_sb, stride_azp, SWAP, HAS_BIAS, HAS_AZP,
                      BLOCK_R, BLOCK_C, FAST)


# ----------------------------------------------------------------------------------------- launcher


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    azp_adj: torch.Tensor | None = None,
    azp: torch.Tensor | None = None,
    *,
    config: MMConfig | None = None,
) -> torch.Tensor:
    """Triton W8A8 GEMM; see the module docstring. `config` overrides the tuning table (for tuning)."""
    _check_args(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp)
    M, K = a.shape
    N = b.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    cfg = config or select_config(a.dtype, N, K, M, a.device)
    _launch(a, b, out, scale_a, scale_b, bias, azp_adj, azp, cfg)
    return out


def scaled_mm_gated(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    activation: str = "silu",
    bias: torch.Tensor | None = None,
    *,
    config: MMConfig | None = None,
) -> torch.Tensor:
    """`act(gate) * up` of an FP8 gate/up GEMM in one launch: b `[2N, K]` (gate rows, then up rows, as
    gate_up_proj lays them out) -> `[M, N]`, writing half the bytes of `act_mul(scaled_mm(a, b, ...), activation)`
    and equal to it bit for bit where `scaled_mm` runs the same tile unsplit (its large-M configs). Each output tile
    holds a gate and an up accumulator, together as many values as the table's config for the `[2N, K]` GEMM holds
    (its longer side halved); the decode-sized (swapped) and split-K configs are not gated: those M take the default
    large-M tile."""
    _check_args(a, b, scale_a, scale_b, out_dtype, bias, None, None)
    if a.dtype != torch.float8_e4m3fn:
        raise ValueError(f"scaled_mm_gated: FP8 activations and weights only, got {a.dtype}")
    M, K = a.shape
    if b.shape[0] % 2:
        raise ValueError(f"scaled_mm_gated: b must hold gate rows then up rows (an even count), got {b.shape[0]}")
    N = b.shape[0] // 2
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    cfg = config or select_config(a.dtype, 2 * N, K, M, a.device)
    if cfg.swap or cfg.split_k > 1:
        cfg = default_config(2 * N, K, max(M, SMALL_M + 1), _num_sms(a.device))
    # Two accumulators in the registers of one: halve the config's longer side (a 256-row tile with two 64-wide
    # halves spilled in an sm_90 compile; 128 rows with two 128-wide ones did not).
    cfg = replace(cfg, block_r=cfg.block_r // 2) if cfg.block_r > cfg.block_c else replace(
        cfg, block_c=max(16, cfg.block_c // 2))
    _launch(a, b, out, scale_a, scale_b, bias, None, None, cfg,
            activation=_activation.activation_code(activation))
    return out


def scaled_mm_gated_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    activation: str = "silu",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference of `scaled_mm_gated`: the GEMM's output rounded to `out_dtype`, then act(gate) * up in
    fp32, rounded once (with the kernels' SiLU expression)."""
    gate_up = scaled_mm_ref(a, b, scale_a, scale_b, out_dtype, bias).float()
    gate, up = gate_up.chunk(2, dim=-1)
    return (_activation.activate_as_kernels_ref(gate, activation) * up).to(out_dtype)


def _launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
            bias: torch.Tensor | None, azp_adj: torch.Tensor | None, azp: torch.Tensor | None, cfg: MMConfig,
            activation: int | None = None) -> None:
    """One `_scaled_mm_kernel` launch writing `out [M, N]`; `activation` set: gated (b holds 2N rows)."""
    gated = activation is not None
    M, K = a.shape
    N = out.shape[1]
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    use_tma = cfg.tma and _tma_ok(a) and _tma_ok(b)
    R, C = (N, M) if cfg.swap else (M, N)
    num_rc = triton.cdiv(R, cfg.block_r) * triton.cdiv(C, cfg.block_c)
    split_k = max(1, min(cfg.split_k, triton.cdiv(K, cfg.block_k)))
    if split_k > 1 and num_rc > common.ARRIVAL_SLOTS:
        split_k = 1
    num_tiles = num_rc * split_k
    num_progs = min(num_tiles, _num_sms(a.device)) if cfg.persistent else num_tiles
    acc_dtype = torch.int32 if a.dtype == torch.int8 else torch.float32
    ws = torch.empty(num_tiles * cfg.block_r * cfg.block_c if split_k > 1 else 1, dtype=acc_dtype, device=a.device)
    on_gpu = a.is_cuda and common.is_hopper_or_newer(a.device)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if a.is_cuda:
        launch["launch_pdl"] = cfg.pdl and on_gpu
    if use_tma:
        triton.set_allocator(_triton_alloc)
    sa, stride_sa = _flat_with_stride(scale_a, torch.float32)
    sb, stride_sb = _flat_with_stride(scale_b, torch.float32)
    azp_t, stride_azp = _flat_with_stride(azp, torch.int32) if azp is not None else (sa, 0)
    adj = azp_adj.reshape(-1).to(torch.int32).contiguous() if azp_adj is not None else sa
    bias_t = bias.reshape(-1).contiguous() if bias is not None else sa
    _scaled_mm_kernel[(num_progs,)](
        a, b, out, sa, sb, bias_t, adj, azp_t, ws, common.arrival_counters(a.device),
        M, N, K, a.stride(0), b.stride(0), out.stride(0), stride_sa, stride_sb, stride_azp,
        num_progs, cfg.group, split_k,
        IS_INT8=a.dtype == torch.int8, SWAP=cfg.swap, HAS_BIAS=bias is not None, HAS_AZP=azp is not None,
        USE_TMA=use_tma, FLATTEN=cfg.flatten, SPLIT=split_k > 1, USE_PDL=cfg.pdl and on_gpu,
        PREFETCH=cfg.prefetch and cfg.swap and use_tma and on_gpu,
        PRECISE=cfg.precise_acc and on_gpu and a.dtype != torch.int8, FAST=a.is_cuda,
        BLOCK_R=cfg.block_r, BLOCK_C=cfg.block_c, BLOCK_K=cfg.block_k,
        GATED=gated, ACTIVATION=activation if gated else 0, **launch,
    )


def _flat_with_stride(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    flat = t.reshape(-1).to(dtype).contiguous()
    return flat, (0 if flat.numel() == 1 else 1)


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a 16-byte aligned base and row stride (8-bit elements: stride % 16 == 0)."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def _triton_alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _num_sms(device: torch.device) -> int:
    # Off CUDA (the interpreter) a small count keeps the persistent loop exercised by tests.
    return common.num_sms(device, off_cuda=4)


# ------------------------------------------------------------------------------------ tuning table


def m_bucket(M: int) -> int:
    """Power-of-two bucket holding M (16 covers 1..16); 8192 covers everything above 4096."""
    return min(8192, max(16, 1 << max(0, (M - 1).bit_length())))


def dtype_key(dtype: torch.dtype) -> str:
    return "int8" if dtype == torch.int8 else "fp8"


def table_path(gpu_name: str) -> Path:
    return TUNING_DIR / f"scaled_mm_{common.gpu_key(gpu_name)}.json"


@functools.cache
def load_table(gpu_name: str) -> dict:
    path = table_path(gpu_name)
    if not path.exists():
        return {}
    return json.loads(path.read_text()).get("configs", {})


@functools.cache
def _device_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def select_config(dtype: torch.dtype, N: int, K: int, M: int, device: torch.device) -> MMConfig:
    """Tuned entry for (GPU, dtype, N, K, M bucket), the nearest tuned bucket of that shape, or a default."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        entries = load_table(_device_name(index)).get(dtype_key(dtype), {}).get(f"{N},{K}", {})
        cfg = lookup(entries, M)
        if cfg is not None:
            return cfg
    return default_config(N, K, M, _num_sms(device))


def lookup(entries: dict[str, dict], M: int) -> MMConfig | None:
    """The entry of M's bucket, else of the nearest tuned bucket on the same side of SMALL_M."""
    if not entries:
        return None
    bucket = m_bucket(M)
    tuned = [int(b) for b in entries]
    same_side = [b for b in tuned if (b <= SMALL_M) == (bucket <= SMALL_M)] or tuned
    best = min(same_side, key=lambda b: abs(math.log2(b) - math.log2(bucket)))
    return _fit_block_c(MMConfig.from_json(entries[str(best)]), M)


def _fit_block_c(cfg: MMConfig, M: int) -> MMConfig:
    """A swapped config borrowed from another bucket keeps the token tile at the batch's size."""
    if cfg.swap:
        return replace(cfg, block_c=max(16, min(cfg.block_c, triton.next_power_of_2(M))))
    return cfg


def default_config(N: int, K: int, M: int, num_sms: int) -> MMConfig:
    """Untuned shapes: the H200 sweep's most common winners (docs/kernels-gemm.md)."""
    if M <= SMALL_M:
        block_r, block_k = 64, 256
        tiles = triton.cdiv(N, block_r)
        k_tiles = triton.cdiv(K, block_k)
        # Split K only when the weight rows alone leave most SMs idle.
        split = max(1, min(k_tiles // 4, num_sms // tiles)) if tiles < num_sms // 2 else 1
        return MMConfig(swap=True, block_r=block_r, block_c=max(16, triton.next_power_of_2(M)),
                        block_k=block_k, split_k=split, num_warps=4, num_stages=6)
    if M <= 256:
        return MMConfig(swap=False, block_r=64, block_c=128, block_k=128, num_warps=4, num_stages=4,
                        persistent=True)
    return MMConfig(swap=False, block_r=128, block_c=256, block_k=128, num_warps=8, num_stages=4,
                    persistent=True)
