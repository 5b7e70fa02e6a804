"""The fused MoE MLP for decode-sized steps (a few tokens): two GEMV-style launches, no alignment, no padding.

At T <= 8 tokens the grouped GEMM of `fused_moe` pads every chosen expert's handful of pairs to a BLOCK_M of 16
rows, depends on the alignment launch, and (FP8) on activation-quantizer launches; at one token its fixed costs
outweigh reading the chosen experts' weights. Here every program reads its expert's weights straight from
`topk_ids`, with wide loads along K and fp32 FMA (no tensor cores: one to eight rows):

1. gate_up: one program per (pair p = t * k + j, BLOCK_N columns of the intermediate). It streams the gate and up
   rows of expert `topk_ids[p]` over K = H against x[t] and writes `act(gate) * up`, rounded once to x's dtype,
   to `inter [T*k, I]`.
2. down: one program per (token t, BLOCK_N columns of the output). It loops over the token's k experts in slot
   order, each `w2[e] @ inter[p]` in fp32, times its routing weight, summed in fp32 and rounded once to the output:
   no atomics, no zero fill, no separate k-sum. (`split_down`: one program per pair instead, for k times the
   programs where one token's columns are too few; each writes its fp32 product and a k-sum launch (or, with the
   launch feature `moe_k_sum`, the last of a token's k programs of a column block to arrive at its counter) sums
   them in slot order (`moe_common.k_sum` either way): the same fp32 operations in the same order, bit-identical
   in the interpreter, while on the GPU the fused loop's weighting may compile to an FMA, so the two can differ by
   the last bit of a rounding.)

Pairs of expert -1 (another expert-parallel rank's) are skipped. FP8 experts (float8_e4m3fn weights, per-channel
`[E, N]` / `[E, N, 1]` or block `[E, ceil(N/bn), ceil(K/bk)]` fp32 scales) are dequantized in registers and the
activations stay in x's dtype (W8A16): no activation-quantizer launches. That differs from `fused_moe`'s W8A8
numerics (x and the intermediate quantized to e4m3) by the activations' quantization error: it is more exact, and
`fused_moe_small_t_ref` states it.

Numerics, shared by the reference: both GEMMs accumulate in fp32 (weights dequantized in fp32); `act(gate) * up` in
fp32 rounded once to x's dtype; each expert's down output times its weight in fp32, the k summed in fp32 in slot
order, rounded once.

Launch sizes come from `SmallTConfig` (`select_small_t`); `max_tokens` decides up to which T `fused_moe` takes this
path: 0 (never) by default, a per-GPU table entry per layer shape and weight kind where one was measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels import activation as _activation
from kestrel.kernels import common
from kestrel.kernels import moe_common as _fm


@dataclass(frozen=True)
class SmallTConfig:
    """Tiles of the two launches. `block_k` is the K span a program loads per step (block FP8 splits it into
    sub-steps of the scale block's width, each with its own scales)."""

    max_tokens: int = 0  # fused_moe takes this path for 1 <= T <= max_tokens
    block_n13: int = 16
    block_k13: int = 256
    block_n2: int = 16
    block_k2: int = 256
    num_warps: int = 4  # of the gate_up launch
    num_warps2: int = 4  # of the down launch
    # K steps (times k for the down launch) unrolled into straight-line loads at most; more take a loop.
    max_unroll: int = 32
    # The down launch per pair rather than per token (k times the programs), its k-sum by the last to arrive.
    split_down: bool = False

    def to_json(self) -> dict:
        return asdict(self)


# Off until measured: a per-GPU table `tuning/moe_small_t_<gpu>.json` (written by scripts/h200_moe_small_t.py) turns
# the path on per layer shape and weight kind, up to the T where it was measured faster than the grouped GEMM. The
# H200's (Qwen3-30B-A3B's experts) passed the full-load MoE run under it (docs/benchmarks.md).
DEFAULT = SmallTConfig()
TABLE = "moe_small_t"


def table_key(num_experts: int, inter: int, hidden: int, kind: str) -> str:
    """The tuning table's key of a layer shape and weight kind (`bf16` for unquantized experts of any dtype,
    `fp8_channel`, `fp8_block`)."""
    return f"{num_experts},{2 * inter},{hidden},{kind}"


def weight_kind(fp8: bool, block_shape: tuple[int, int] | None) -> str:
    return "bf16" if not fp8 else ("fp8_channel" if block_shape is None else "fp8_block")


def select_small_t(T: int, choice: SmallTConfig | bool | None = None, key: str | None = None,
                   device: torch.device | None = None) -> SmallTConfig | None:
    """The config to run T tokens with on this path, or None for the grouped GEMM. `choice`: None picks by T
    (the GPU's table entry for `key` if there is one, else `DEFAULT`, up to its `max_tokens`), False never, True
    always with `DEFAULT`'s tiles, a config always with its tiles."""
    if choice is None:
        cfg = DEFAULT
        if key is not None and device is not None:
            entry = common.gpu_table(TABLE, device).get(key)
            if entry is not None:
                cfg = SmallTConfig(**entry)
        return cfg if 1 <= T <= cfg.max_tokens else None
    if choice is False:
        return None
    return DEFAULT if choice is True else choice


# ----------------------------------------------------------------------------------------- reference


def fused_moe_small_t_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    config: SmallTConfig | None = None,
) -> torch.Tensor:
    """PyTorch reference: per chosen expert, its pairs' two matmuls in fp32 on the (dequantized) weights, the
    activations unquantized; the k weighted outputs summed in fp32 in slot order. `config` is unused (the
    kernel's signature)."""
    T, H, E, inter, k, fp8 = _fm._check_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape)
    _activation.activation_code(activation)
    ids = topk_ids.long()
    down = torch.zeros(T, k, H, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in torch.unique(ids[ids >= 0]).tolist():
        t_idx, j_idx = (ids == e).nonzero(as_tuple=True)
        w13e = _fm._dequant_weight_ref(w13[e], w13_scale[e], block_shape) if fp8 else w13[e].float()
        w2e = _fm._dequant_weight_ref(w2[e], w2_scale[e], block_shape) if fp8 else w2[e].float()
        gate_up = xf[t_idx] @ w13e.T
        h = (_activation.activate_ref(gate_up[:, :inter], activation) * gate_up[:, inter:]).to(x.dtype).float()
        down[t_idx, j_idx] = (h @ w2e.T) * topk_weights[t_idx, j_idx].float()[:, None]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for j in range(k):  # slot order, as the kernel sums
        out += down[:, j]
    return out.to(x.dtype)


# ------------------------------------------------------------------------------------------- kernels


@triton.jit
def _row_dot(acc, w_ptr, row_off, k0, K, x_vec, s_ptr, s_rows, ok, QUANT: tl.constexpr, SCALE_BK: tl.constexpr,
             SUB: tl.constexpr, EVEN_K: tl.constexpr):
    """acc [BLOCK_N, SUB] += w[rows, k0:k0+SUB] (dequantized) * x_vec[None, :], the loads predicated on the scalar
    `ok` (a skipped pair reads nothing). Block FP8: the SUB columns lie in one scale column, `s_ptr + s_rows`
    points at each row's scale row."""
    offs = k0 + tl.arange(0, SUB)
    ptrs = w_ptr + row_off[:, None] + offs[None, :]
    if EVEN_K:
        mask = ok & (row_off >= 0)[:, None]
    else:
        mask = ok & (offs < K)[None, :]
    w = _fm._load(ptrs, mask, True, QUANT != 0).to(tl.float32)
    if QUANT == 2:
        # A K tail's sub-step past K has no scale column: masked (its weights are masked to 0 already).
        s = tl.load(s_ptr + s_rows + k0 // SCALE_BK, mask=ok & (s_rows >= 0) & (k0 < K), other=0.0)
        w = w * s[:, None]
    return acc + w * x_vec[None, :]


@triton.jit
def _load_vec(ptr, k0, K, ok, SUB: tl.constexpr):
    offs = k0 + tl.arange(0, SUB)
    return tl.load(ptr + offs, mask=ok & (offs < K), other=0.0).to(tl.float32)


@triton.jit
def _gate_up_step(acc_g, acc_u, x_row, w_base, gate_off, up_off, s_base, gate_s, up_s, k0, K, ok,
                  QUANT: tl.constexpr, SCALE_BK: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
                  SUB: tl.constexpr):
    for sub in tl.static_range(BLOCK_K // SUB):
        ks = k0 + sub * SUB
        xv = _load_vec(x_row, ks, K, ok, SUB)
        acc_g = _row_dot(acc_g, w_base, gate_off, ks, K, xv, s_base, gate_s, ok, QUANT, SCALE_BK, SUB, EVEN_K)
        acc_u = _row_dot(acc_u, w_base, up_off, ks, K, xv, s_base, up_s, ok, QUANT, SCALE_BK, SUB, EVEN_K)
    return acc_g, acc_u


@triton.jit
def _down_step(acc, a_row, w_base, w_off, s_base, s_rows, k0, K, ok, QUANT: tl.constexpr, SCALE_BK: tl.constexpr,
               EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr):
    for sub in tl.static_range(BLOCK_K // SUB):
        ks = k0 + sub * SUB
        av = _load_vec(a_row, ks, K, ok, SUB)
        acc = _row_dot(acc, w_base, w_off, ks, K, av, s_base, s_rows, ok, QUANT, SCALE_BK, SUB, EVEN_K)
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, inter_ptr, N, K, top_k,
                    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_im,
                    ACTIVATION: tl.constexpr, QUANT: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                    FAST: tl.constexpr, EVEN_K: tl.constexpr, K_STEPS: tl.constexpr, STATIC_K: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr, USE_PDL: tl.constexpr):
    """inter[p, n] = round(act(w[e, n] . x[t]) * (w[e, N + n] . x[t])), e = ids[p], t = p // top_k.
    STATIC_K: the K_STEPS steps unrolled (straight-line loads the compiler can issue ahead)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    p = tl.program_id(0)
    expert = tl.load(ids_ptr + p).to(tl.int64)
    if expert < 0:
        return
    ok = expert >= 0
    t = p // top_k
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrapped rows keep the loads in bounds without a mask; their results are not stored.
    rows = (cols % N).to(tl.int64)
    w_base = w_ptr + expert * stride_we
    gate_off = rows * stride_wn
    up_off = (rows + N) * stride_wn
    s_base = s_ptr + expert * stride_se
    if QUANT == 2:
        gate_s = (rows // SCALE_BN) * stride_sn
        up_s = ((rows + N) // SCALE_BN) * stride_sn
    else:
        gate_s = rows
        up_s = rows
    acc_g = tl.zeros((BLOCK_N, SUB), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, SUB), dtype=tl.float32)
    x_row = x_ptr + t * stride_xm
    if STATIC_K:
        for kt in tl.static_range(K_STEPS):
            acc_g, acc_u = _gate_up_step(acc_g, acc_u, x_row, w_base, gate_off, up_off, s_base, gate_s, up_s,
                                         kt * BLOCK_K, K, ok, QUANT, SCALE_BK, EVEN_K, BLOCK_K, SUB)
    else:
        for k0 in range(0, K, BLOCK_K):
            acc_g, acc_u = _gate_up_step(acc_g, acc_u, x_row, w_base, gate_off, up_off, s_base, gate_s, up_s,
                                         k0, K, ok, QUANT, SCALE_BK, EVEN_K, BLOCK_K, SUB)
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if QUANT == 1:
        gate = gate * tl.load(s_base + rows * stride_sn)
        up = up * tl.load(s_base + (rows + N) * stride_sn)
    h = _activation.activate(gate, ACTIVATION) * up
    tl.store(inter_ptr + p * stride_im + cols, common.to_dtype(h, inter_ptr.dtype.element_ty, FAST), mask=cols < N)


@triton.jit
def _down_kernel(inter_ptr, w_ptr, s_ptr, ids_ptr, weights_ptr, out_ptr, sum_ptr, lock_ptr, N, K,
                 stride_im, stride_we, stride_wn, stride_se, stride_sn, stride_om, stride_sm,
                 TOP_K: tl.constexpr, QUANT: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                 FAST: tl.constexpr, EVEN_K: tl.constexpr, K_STEPS: tl.constexpr, STATIC_K: tl.constexpr,
                 SPLIT: tl.constexpr, FUSED_SUM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SUB: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t, n] = round(sum_j weights[t, j] * (w[e_j, n] . inter[t * TOP_K + j])) over the kept slots j. A skipped
    slot's loads are predicated off rather than branched around (it adds 0), so with STATIC_K the k experts' loads
    form one straight line. SPLIT: one program per pair instead of per token (k times the programs), each writing its
    fp32 product to out[p] for a k-sum: the same fp32 operations in the same order. FUSED_SUM: that k-sum is done by
    the last of a token's k programs of a column block to arrive at its counter (acq_rel), into sum_ptr, as
    `_moe_sum_kernel` does it, and the counter zeroed again."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (cols % N).to(tl.int64)
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(1 if SPLIT else TOP_K):
        p = t if SPLIT else t * TOP_K + j
        expert = tl.load(ids_ptr + p).to(tl.int64)
        ok = expert >= 0
        expert = tl.maximum(expert, 0)
        w_base = w_ptr + expert * stride_we
        s_base = s_ptr + expert * stride_se
        if QUANT == 2:
            s_rows = (rows // SCALE_BN) * stride_sn
        else:
            s_rows = rows
        acc = tl.zeros((BLOCK_N, SUB), dtype=tl.float32)
        a_row = inter_ptr + p * stride_im
        if STATIC_K:
            for kt in tl.static_range(K_STEPS):
                acc = _down_step(acc, a_row, w_base, rows * stride_wn, s_base, s_rows, kt * BLOCK_K, K, ok, QUANT,
                                 SCALE_BK, EVEN_K, BLOCK_K, SUB)
        else:
            for k0 in range(0, K, BLOCK_K):
                acc = _down_step(acc, a_row, w_base, rows * stride_wn, s_base, s_rows, k0, K, ok, QUANT, SCALE_BK,
                                 EVEN_K, BLOCK_K, SUB)
        part = tl.sum(acc, axis=1)
        if QUANT == 1:
            part = part * tl.load(s_base + rows * stride_sn, mask=ok & (rows >= 0), other=0.0)
        out += part * tl.where(ok, tl.load(weights_ptr + p), 0.0)
    if SPLIT:
        tl.store(out_ptr + t * stride_om + cols, out, mask=cols < N)
        if FUSED_SUM:
            token = t // TOP_K
            slot = lock_ptr + token * tl.num_programs(1) + tl.program_id(1)
            if common.last_arrival(slot, TOP_K):
                total = _fm.k_sum(out_ptr, ids_ptr, token, cols, cols < N, stride_om, TOP_K, BLOCK_N, ".cg")
                tl.store(sum_ptr + token * stride_sm + cols, common.to_dtype(total, sum_ptr.dtype.element_ty, FAST),
                         mask=cols < N)
                tl.atomic_xchg(slot, 0)
    else:
        tl.store(out_ptr + t * stride_om + cols, common.to_dtype(out, out_ptr.dtype.element_ty, FAST), mask=cols < N)


# ----------------------------------------------------------------------------------------- launcher


def _sub_width(block_k: int, block_shape: tuple[int, int] | None) -> int:
    """A sub-step's width: block_k, or for block FP8 the largest power of two dividing bk (<= block_k), so
    each sub-step's columns share one scale column."""
    if block_shape is None:
        return block_k
    bk = block_shape[1]
    return min(block_k, bk & -bk)


def fused_moe_small_t(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    config: SmallTConfig | None = None,
) -> torch.Tensor:
    """Triton `fused_moe_small_t_ref` in two launches; see the module docstring. Any T works (the tiles are
    sized for a few tokens). No host sync: capturable in a CUDA graph."""
    T, H, E, inter, k, fp8 = _fm._check_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape)
    code = _activation.activation_code(activation)
    cfg = config or DEFAULT
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"fused_moe_small_t: {name} must be contiguous along its last dimension")
    ids = topk_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    quant = _fm._NONE if not fp8 else (_fm._PER_CHANNEL if block_shape is None else _fm._BLOCK)
    if quant == _fm._BLOCK:
        s13, s2 = w13_scale.contiguous(), w2_scale.contiguous()
        scale_bn, scale_bk = block_shape
    elif quant == _fm._PER_CHANNEL:
        s13, s2 = w13_scale.reshape(E, -1).contiguous(), w2_scale.reshape(E, -1).contiguous()
        scale_bn = scale_bk = 1
    else:
        s13 = s2 = weights  # placeholders the kernels never read
        scale_bn = scale_bk = 1
    fast = x.is_cuda
    pdl = common.pdl_options(x, "pdl_decode")
    inter_t = torch.empty(T * k, inter, dtype=x.dtype, device=x.device)
    bk13 = min(cfg.block_k13, triton.next_power_of_2(H))
    sub13 = _sub_width(bk13, block_shape)
    _gate_up_kernel[(T * k, triton.cdiv(inter, cfg.block_n13))](
        x, w13, s13, ids, inter_t, inter, H, k,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1) if s13.dim() > 1 else 0,
        inter_t.stride(0),
        ACTIVATION=code, QUANT=quant, SCALE_BN=scale_bn, SCALE_BK=scale_bk, FAST=fast,
        EVEN_K=H % bk13 == 0, K_STEPS=triton.cdiv(H, bk13), STATIC_K=triton.cdiv(H, bk13) <= cfg.max_unroll,
        BLOCK_N=cfg.block_n13, BLOCK_K=bk13, SUB=sub13, num_warps=cfg.num_warps, **pdl,
    )
    bk2 = min(cfg.block_k2, triton.next_power_of_2(inter))
    sub2 = _sub_width(bk2, block_shape)
    # split_down: one program per pair, fp32 products summed over k (k times the programs).
    split = cfg.split_down and k > 1
    down = torch.empty(T * k, H, dtype=torch.float32, device=x.device) if split else out
    n_blocks2 = triton.cdiv(H, cfg.block_n2)
    # The k-sum by the last program of each (token, column block) to arrive, where the counters suffice.
    fused_sum = split and T * n_blocks2 <= common.ARRIVAL_SLOTS and common.launch_feature("moe_k_sum", x.device)
    _down_kernel[(T * k if split else T, n_blocks2)](
        inter_t, w2, s2, ids, weights, down, out, common.arrival_counters(x.device) if fused_sum else out, H, inter,
        inter_t.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1) if s2.dim() > 1 else 0,
        down.stride(0), out.stride(0),
        TOP_K=k, QUANT=quant, SCALE_BN=scale_bn, SCALE_BK=scale_bk, FAST=fast, EVEN_K=inter % bk2 == 0,
        K_STEPS=triton.cdiv(inter, bk2), STATIC_K=(1 if split else k) * triton.cdiv(inter, bk2) <= cfg.max_unroll,
        SPLIT=split, FUSED_SUM=fused_sum, BLOCK_N=cfg.block_n2, BLOCK_K=bk2, SUB=sub2, num_warps=cfg.num_warps2,
        **pdl,
    )
    if split and not fused_sum:
        block = min(_fm._SUM_BLOCK, triton.next_power_of_2(H))
        _fm._moe_sum_kernel[(T, triton.cdiv(H, block))](down, ids, out, H, TOP_K=k, BLOCK=block, FAST=fast,
                                                         num_warps=4 if block >= 512 else 1, **pdl)
    return out
