"""Fused mixture-of-experts MLP: every token's top-k experts' gated MLPs, weighted and summed, in three launches
after a device-side routing sort (plus the activation quantization of the FP8 paths).

`out[t] = sum_j topk_weights[t, j] * w2[e] @ (act(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))`, `e = topk_ids[t, j]`,
with `w13` `[E, 2*I, H]` (gate rows, then up rows: the merged gate_up layout) and `w2` `[E, H, I]`. A pair whose
expert id is -1 (an expert another expert-parallel rank owns) contributes nothing.

Numerics (the reference and the kernel agree on them): both GEMMs accumulate in fp32; `act(gate) * up` is
computed in fp32 and rounded once to x's dtype (the intermediate a model-dtype MLP would hold); each expert's
down output is multiplied by its routing weight in fp32, the k products are summed in fp32 and rounded once.

W8A8-FP8 experts (`w13`, `w2` float8_e4m3fn with fp32 `w13_scale`, `w2_scale`): activations are quantized
dynamically to e4m3 as `kernels/quant_act.py` does (`s = max(amax / 448, 1e-12)`, `q = rne(sat(y * (1 / s)))`):
x once per token (shared by its k pairs), the intermediate (after its rounding to x's dtype) once per pair row.
- per channel (`block_shape=None`): `w13_scale [E, 2I]`, `w2_scale [E, H]` (a trailing 1 is accepted), one
  activation scale per row; the epilogue is `acc * s_a[row] * s_w[e, n]`. The intermediate is written in x's
  dtype and quantized by a separate per-token launch (a row's amax spans every column program).
  `reduce_inter_amax` (per channel only): a rank holding a slice of every expert's intermediate dimension
  passes the max over its tensor-parallel group, applied to each pair row's absmax `[T*k, 1]` fp32 before the
  intermediate is quantized; the result rides along as an extra column, so every rank quantizes with the scale
  one device would use (the block-wise path needs none: a rank's slice holds whole groups).
- block-wise (`block_shape=(bn, bk)`, DeepSeek-V3 / Qwen3-FP8 style): `w13_scale [E, ceil(2I/bn), ceil(H/bk)]`,
  `w2_scale [E, ceil(H/bn), ceil(I/bk)]` (I a multiple of bn: gate and up rows keep their own scale rows);
  activations get one scale per row per bk columns. BLOCK_K == bk, and each K step's partial dot is scaled
  by `s_a[row, kt] * s_w[e, n // bn, kt]` before it joins the fp32 accumulator. The first GEMM runs with
  BLOCK_N == bk, so each program holds whole quantization groups of the intermediate and quantizes them in
  its epilogue (no 16-bit intermediate is written).

The Triton path, as vLLM's fused_moe organises it:
1. `moe_align`: the valid (token, slot) pairs sorted by expert, each expert's run padded to a multiple of
   BLOCK_M with a sentinel (`T*k`), one expert id per block, and the padded total on the device; pairs of
   expert -1 land in no block. No host sync: buffers are sized by the bound `T*k + min(E, T*k) * (BLOCK_M - 1)`,
   so it can be captured in a CUDA graph; programs of blocks past the real total return at once. Decode-sized
   steps take one launch (`moe_routing.moe_align_single`), larger ones a stable torch sort.
2. A grouped GEMM, launched twice. Each program takes one BLOCK_M block of sorted pairs (one expert) and a
   BLOCK_N column slice. First `x @ w13[e]^T` with the gate and up tiles of the same columns accumulated side
   by side, so the epilogue writes `act(gate) * up` `[T*k, I]` directly; then `inter @ w2[e]^T` with the
   routing weight applied in the epilogue, written in fp32 `[T*k, H]` (in x's dtype straight to the output,
   zero-filled first for the skipped pairs, when k == 1).
3. A small kernel sums the k rows of each token in fp32 (skipping pairs of expert -1) and rounds once.

Decode-sized steps may instead take `moe_small_t` (two GEMV-style launches straight from `topk_ids`, FP8 weights
dequantized in registers with unquantized activations), chosen by T in `fused_moe` (`small_t`).

Block sizes come from a JSON table chosen offline (`tuning/fused_moe_default.json`, by M = T bucket; a
per-GPU `tuning/fused_moe_<gpu>.json` keyed by `E,2I,H,kind` overrides it, kind `bf16`, `fp8_channel` or
`fp8_block`, FP8 weights falling back to the shape's `bf16` entry); nothing autotunes at run time. Block
FP8 overrides BLOCK_K (both GEMMs) and the first GEMM's BLOCK_N with bk.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels import activation as _activation
from kestrel.kernels import common, moe_small_t
from kestrel.kernels import moe_routing as _routing
from kestrel.kernels import quant_act as _quant_act
from kestrel.kernels.moe_common import (  # noqa: F401 - shared with moe_small_t; tests read them here too
    _BLOCK,
    _NONE,
    _PER_CHANNEL,
    _ROUND,
    _SUM_BLOCK,
    _check_args,
    _check_scales,
    _dequant_weight_ref,
    _load,
    _moe_sum_kernel,
)

DEFAULT_TABLE = common.TUNING_DIR / "fused_moe_default.json"


@dataclass(frozen=True)
class MoEConfig:
    """Launch parameters shared by both GEMMs (the alignment's BLOCK_M ties them). The first GEMM holds a gate
    and an up accumulator of `block_m x block_n` each."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1  # row blocks that sweep the column slices together (weight tiles reused through L2)
    num_warps: int = 4
    num_stages: int = 3

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> MoEConfig:
        return MoEConfig(**d)


# ----------------------------------------------------------------------------------------- reference


def fused_moe_ref(
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
    reduce_inter_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """PyTorch reference and the CPU path: one pair of matmuls per expert over the tokens routed to it. FP8:
    weights dequantized by their scales, activations quantized and dequantized as the kernel quantizes them,
    the matmuls in fp32."""
    T, H, E, inter, k, fp8 = _check_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape,
                                         reduce_inter_amax)
    _activation.activation_code(activation)
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    if T == 0:
        return out.to(x.dtype)
    group = block_shape[1] if block_shape is not None else None
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    skipped = int((flat < 0).sum())  # expert -1 sorts first
    counts = torch.bincount(flat[flat >= 0], minlength=E).tolist()
    order = order[skipped:]
    tokens = order // k
    weights = topk_weights.reshape(-1).float()[order]
    xs = _fake_quant_ref(x, group) if fp8 else x.float()
    spans = [(e, start, n) for e, (start, n) in enumerate(zip(itertools.accumulate([0, *counts]), counts)) if n]
    if not spans:
        return out.to(x.dtype)
    acts = []  # each pair's intermediate in x's dtype, in sorted order
    for e, start, n in spans:
        w13e = _dequant_weight_ref(w13[e], w13_scale[e], block_shape) if fp8 else w13[e].float()
        gate_up = xs.index_select(0, tokens[start:start + n]) @ w13e.T
        acts.append((_activation.activate_ref(gate_up[:, :inter], activation) * gate_up[:, inter:]).to(x.dtype))
    act = torch.cat(acts)
    act = _fake_quant_ref(act, group, reduce_inter_amax) if fp8 else act.float()
    for e, start, n in spans:
        w2e = _dequant_weight_ref(w2[e], w2_scale[e], block_shape) if fp8 else w2[e].float()
        down = act[start:start + n] @ w2e.T
        out.index_add_(0, tokens[start:start + n], down * weights[start:start + n, None])
    return out.to(x.dtype)


def _fake_quant_ref(y: torch.Tensor, group: int | None,
                    reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """y quantized to e4m3 per row (per row and group of `group` columns) and dequantized, in fp32."""
    q, s = _quant_fp8(y, group, _quant_act.quant_fp8_per_token_ref, reduce_amax)
    R, C = y.shape
    return (q.float().reshape(R, s.shape[1], -1) * s[:, :, None]).reshape(R, -1)[:, :C]


def _quant_fp8(y: torch.Tensor, group: int | None, quantize,
               reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic e4m3 quantization of y `[R, C]` by `quantize` (quant_act's per-token kernel or reference): one
    scale per row, or per row and group of `group` columns (each group quantized as a row of its own, the
    columns padded with zeros to a whole group). Returns q `[R, C or G * group]` and scales `[R, 1 or G]`.
    `reduce_amax` (per row only): each row's absmax `[R, 1]` fp32 -> the absmax to quantize with, appended as an
    extra column that the quantizer sees and the result drops."""
    if group is None:
        if reduce_amax is not None:
            amax = reduce_amax(y.abs().amax(dim=1, keepdim=True).float())
            qa = quantize(torch.cat([y, amax.to(y.dtype)], dim=1))
            return qa.q[:, :-1], qa.scale.reshape(-1, 1)
        qa = quantize(y)
        return qa.q, qa.scale.reshape(-1, 1)
    R, C = y.shape
    G = triton.cdiv(C, group)
    if C % group:
        y = F.pad(y, (0, G * group - C))
    qa = quantize(y.contiguous().reshape(R * G, group))
    return qa.q.reshape(R, G * group), qa.scale.reshape(R, G)


# ------------------------------------------------------------------------------------------- routing


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs `p = t * k + j` grouped by expert, each expert's run padded to a multiple of `block_m`.

    Returns `sorted_ids` int32 `[num_blocks * block_m]` (pair indices; `T*k` marks padding), `expert_ids`
    int32 `[num_blocks]` (the expert of each block; blocks past the real total repeat the last expert) and
    `num_padded` int32 `[1]` (the real padded total). `num_blocks` bounds the real count from above and
    depends on shapes only. Pairs keep their order within an expert (a stable sort). Ids must lie in
    [-1, num_experts); pairs of expert -1 appear nowhere.
    """
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    device = flat.device
    num_blocks = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m)
    sorted_e, order = torch.sort(flat, stable=True)  # expert -1 first
    # Run boundaries by binary search rather than bincount: bincount sizes its output on the host.
    bounds = torch.searchsorted(sorted_e, torch.arange(num_experts + 1, dtype=flat.dtype, device=device))
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    run = sorted_e.clamp(min=0)
    dest = padded_start[run] + (torch.arange(n, device=device) - bounds[run])
    # Skipped pairs go to one slot past the end, cut off below.
    dest = torch.where(sorted_e >= 0, dest, num_blocks * block_m)
    sorted_ids = torch.full((num_blocks * block_m + 1,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, num_blocks * block_m, block_m, device=device, dtype=padded_end.dtype)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids[:-1], expert_ids.to(torch.int32), padded_end[-1:].to(torch.int32)


# ------------------------------------------------------------------------------------------- kernels


@triton.jit
def _dot(a, w, acc, DOT_F32: tl.constexpr, PRECISE: tl.constexpr, BLOCK_K: tl.constexpr):
    if DOT_F32:
        # fp32 dots: the interpreter multiplies bf16 blocks wrongly (numpy has no bf16); fp32 models want ieee.
        acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    elif PRECISE:
        # FP8 on sm_90: promote the tensor cores' reduced-precision sums into fp32 every BLOCK_K.
        acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
    else:
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _round_to(h, ROUND: tl.constexpr, FAST: tl.constexpr):
    """fp32 h rounded to the intermediate's dtype (0 fp32, 1 bf16, 2 fp16), as fp32."""
    if ROUND == 1:
        h = common.to_dtype(h, tl.bfloat16, FAST).to(tl.float32)
    elif ROUND == 2:
        h = h.to(tl.float16).to(tl.float32)
    return h


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    a_scale_ptr, w_scale_ptr, out_scale_ptr,
    num_pairs, num_blocks, N, K, top_k,
    stride_am, stride_we, stride_wn, stride_wk, stride_om,
    stride_asm, stride_wse, stride_wsn, stride_osm,
    ACT_MUL: tl.constexpr, ACTIVATION: tl.constexpr, MUL_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr, FAST: tl.constexpr,
    QUANT: tl.constexpr, PRECISE: tl.constexpr, QUANT_OUT: tl.constexpr, ROUND: tl.constexpr,
    SCALE_BN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[p, n] = epilogue(sum_k a[p // top_k, k] * w[e, n, k]) for the BLOCK_M pairs p of one block.
    ACT_MUL: w holds gate rows [0, N) and up rows [N, 2N); the epilogue is act(gate) * up.
    QUANT 1 (per-channel FP8): a and w are fp8, the epilogue multiplies by a_scale[row] * w_scale[e, n].
    QUANT 2 (block FP8, BLOCK_K == bk): each K step's dot is multiplied by a_scale[row, kt] *
    w_scale[e, n // SCALE_BN, kt]. QUANT_OUT: the output, rounded to the ROUND dtype, is quantized to fp8 per
    row over this program's BLOCK_N columns (one group); its scale goes to out_scale[p, pid_n]."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return

    FP8: tl.constexpr = QUANT != 0
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    a_rows = (pairs // top_k).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    # Wrapped column indices keep the weight loads in bounds without a mask; their results are not stored.
    w_cols = (cols % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + w_cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if QUANT != 0:
        a_scale_ptrs = a_scale_ptr + a_rows * stride_asm
        if QUANT == 2:
            w_scale_ptrs = w_scale_ptr + expert * stride_wse + (w_cols // SCALE_BN) * stride_wsn
        else:
            w_scale_ptrs = w_scale_ptr + expert * stride_wse + w_cols * stride_wsn
    if ACT_MUL:
        up_ptrs = w_ptrs + N * stride_wn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if QUANT == 2:
            up_scale_ptrs = w_scale_ptr + expert * stride_wse + ((w_cols + N) // SCALE_BN) * stride_wsn
        elif QUANT == 1:
            up_scale_ptrs = w_scale_ptrs + N * stride_wsn
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = _load(a_ptrs, row_ok[:, None], True, FP8)
            w = _load(w_ptrs, None, False, FP8)
        else:
            k_ok = offs_k < K - kt * BLOCK_K
            a = _load(a_ptrs, row_ok[:, None] & k_ok[None, :], True, FP8)
            w = _load(w_ptrs, k_ok[:, None], True, FP8)
        if QUANT == 2:
            a_s = tl.load(a_scale_ptrs + kt, mask=row_ok, other=0.0)
            part = _dot(a, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), DOT_F32, False, BLOCK_K)
            acc += part * a_s[:, None] * tl.load(w_scale_ptrs + kt)[None, :]
        else:
            acc = _dot(a, w, acc, DOT_F32, PRECISE, BLOCK_K)
        if ACT_MUL:
            if EVEN_K:
                u = _load(up_ptrs, None, False, FP8)
            else:
                u = _load(up_ptrs, k_ok[:, None], True, FP8)
            if QUANT == 2:
                part = _dot(a, u, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), DOT_F32, False, BLOCK_K)
                acc_up += part * a_s[:, None] * tl.load(up_scale_ptrs + kt)[None, :]
            else:
                acc_up = _dot(a, u, acc_up, DOT_F32, PRECISE, BLOCK_K)
            up_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    if QUANT == 1:
        a_s = tl.load(a_scale_ptrs, mask=row_ok, other=0.0)[:, None]
        acc = acc * a_s * tl.load(w_scale_ptrs)[None, :]
        if ACT_MUL:
            acc_up = acc_up * a_s * tl.load(up_scale_ptrs)[None, :]
    if ACT_MUL:
        acc = _activation.activate(acc, ACTIVATION) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    if QUANT_OUT:
        # The columns past N hold wrapped copies of real ones: zero them out of the group's amax.
        h = tl.where(col_ok[None, :], _round_to(acc, ROUND, FAST), 0.0)
        s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(h), axis=1), 448.0), 1e-12)
        q = _quant_act._quantize(h, tl.math.div_rn(1.0, s)[:, None], 0.0, out_ptr.dtype.element_ty, 0, FAST)
        tl.store(out_ptrs, q, mask=out_mask)
        tl.store(out_scale_ptr + pairs.to(tl.int64) * stride_osm + pid_n, s, mask=row_ok)
    else:
        tl.store(out_ptrs, common.to_dtype(acc, out_ptr.dtype.element_ty, FAST), mask=out_mask)


# ----------------------------------------------------------------------------------------- launcher


def fused_moe(
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
    reduce_inter_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    config: MoEConfig | None = None,
    small_t: moe_small_t.SmallTConfig | bool | None = None,
) -> torch.Tensor:
    """Triton `fused_moe_ref`; see the module docstring. `config` overrides the tuning table (tests, tuning).
    No host sync: capturable in a CUDA graph.

    `small_t` (`moe_small_t.select_small_t`: None by T and the GPU's table, False never, True or a `SmallTConfig`
    always): decode-sized steps may take `moe_small_t.fused_moe_small_t` instead, two GEMV launches whose FP8
    path keeps the activations unquantized (so `reduce_inter_amax` has nothing to do there)."""
    T, H, E, inter, k, fp8 = _check_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape,
                                         reduce_inter_amax)
    small = moe_small_t.select_small_t(T, small_t, moe_small_t.table_key(E, inter, H, moe_small_t.weight_kind(
        fp8, block_shape)), x.device)
    if small is not None:
        return moe_small_t.fused_moe_small_t(x, w13, w2, topk_weights, topk_ids, activation, w13_scale=w13_scale,
                                             w2_scale=w2_scale, block_shape=block_shape, config=small)
    code = _activation.activation_code(activation)
    # k == 1: the down GEMM writes the output directly; the rows of skipped pairs must read 0.
    out = (torch.zeros if k == 1 else torch.empty)(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    cfg = config or select_config(E, inter, H, T, x.device, moe_small_t.weight_kind(fp8, block_shape))
    if fp8 and block_shape is not None and x.is_cuda and block_shape[1] < common.FP8_DOT_MIN_K:
        raise ValueError(f"fused_moe: block_shape={tuple(block_shape)}: FP8 experts in blocks of {block_shape[1]} "
                         f"columns need an FP8 tensor-core dot over {block_shape[1]}, and the GPU's reduce over at "
                         f"least {common.FP8_DOT_MIN_K}; blocks of at least {common.FP8_DOT_MIN_K} columns run (the "
                         "published checkpoints' are 128)")
    if x.stride(1) != 1:
        x = x.contiguous()
    num_pairs = T * k
    align = _routing.moe_align_single if num_pairs <= _routing.ALIGN_SINGLE_MAX_PAIRS else moe_align
    sorted_ids, expert_ids, num_padded = align(topk_ids, E, cfg.block_m)
    num_blocks = expert_ids.numel()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    quant = _NONE if not fp8 else (_PER_CHANNEL if block_shape is None else _BLOCK)
    cfg1 = cfg2 = cfg
    if quant == _BLOCK:
        bk = block_shape[1]
        # One K step per scale column; the first GEMM's programs each hold one quantization group.
        cfg1, cfg2 = replace(cfg, block_n=bk, block_k=bk), replace(cfg, block_k=bk)
    launch = common.launch_options(x, "pdl_decode")
    common_args = dict(DOT_F32=not x.is_cuda or (x.dtype == torch.float32 and not fp8), **launch,
                       QUANT=quant, ROUND=_ROUND[x.dtype], SCALE_BN=block_shape[0] if block_shape else 1,
                       PRECISE=quant == _PER_CHANNEL and x.is_cuda and common.is_hopper_or_newer(x.device),
                       BLOCK_M=cfg.block_m, GROUP_M=cfg.group_m, num_warps=cfg.num_warps)

    group = block_shape[1] if block_shape is not None else None
    if fp8:
        a1, a1_scale = _quant_fp8(x, group, _quant_act.quant_fp8_per_token)
        if quant == _BLOCK:
            s13, s2 = w13_scale.contiguous(), w2_scale.contiguous()
        else:
            s13, s2 = w13_scale.reshape(E, -1).contiguous(), w2_scale.reshape(E, -1).contiguous()
    else:
        a1 = a1_scale = s13 = s2 = x  # placeholders the kernel never reads
    if quant == _BLOCK:
        act = torch.empty(num_pairs, inter, dtype=torch.float8_e4m3fn, device=x.device)
        act_scale = torch.empty(num_pairs, triton.cdiv(inter, group), dtype=torch.float32, device=x.device)
    else:
        # Rows of skipped pairs stay unwritten; the per-token quantization reads them (and never uses the
        # result): zeroed off the GPU, where the interpreter's numpy would warn on garbage.
        act = (torch.empty if x.is_cuda else torch.zeros)(num_pairs, inter, dtype=x.dtype, device=x.device)
        act_scale = act
    _moe_gemm_kernel[(num_blocks * triton.cdiv(inter, cfg1.block_n),)](
        a1, w13, act, weights, sorted_ids, expert_ids, num_padded, a1_scale, s13, act_scale,
        num_pairs, num_blocks, inter, H, k,
        a1.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        a1_scale.stride(0), s13.stride(0), s13.stride(1), act_scale.stride(0),
        ACT_MUL=True, ACTIVATION=code, MUL_WEIGHT=False, EVEN_K=H % cfg1.block_k == 0, QUANT_OUT=quant == _BLOCK,
        BLOCK_N=cfg1.block_n, BLOCK_K=cfg1.block_k, num_stages=_stages(cfg1, a1, w13, 2), **common_args,
    )
    if quant == _PER_CHANNEL:
        act, act_scale = _quant_fp8(act, None, _quant_act.quant_fp8_per_token, reduce_inter_amax)
    elif quant == _NONE:
        act_scale = act
    # k == 1: each token's one product is the output, rounded once in the epilogue.
    down = out if k == 1 else torch.empty(num_pairs, H, dtype=torch.float32, device=x.device)
    _moe_gemm_kernel[(num_blocks * triton.cdiv(H, cfg2.block_n),)](
        act, w2, down, weights, sorted_ids, expert_ids, num_padded, act_scale, s2, act_scale,
        num_pairs, num_blocks, H, inter, 1,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), down.stride(0),
        act_scale.stride(0), s2.stride(0), s2.stride(1), 0,
        ACT_MUL=False, ACTIVATION=code, MUL_WEIGHT=True, EVEN_K=inter % cfg2.block_k == 0, QUANT_OUT=False,
        BLOCK_N=cfg2.block_n, BLOCK_K=cfg2.block_k, num_stages=_stages(cfg2, act, w2, 1), **common_args,
    )
    if k > 1:
        ids = topk_ids.reshape(-1)
        block = min(_SUM_BLOCK, triton.next_power_of_2(H))
        _moe_sum_kernel[(T, triton.cdiv(H, block))](down, ids, out, H, TOP_K=k, BLOCK=block,
                                                      num_warps=4 if block >= 512 else 1, **launch)
    return out


def _stages(cfg: MoEConfig, a: torch.Tensor, w: torch.Tensor, weight_tiles: int) -> int:
    """The config's pipeline depth, lowered where its tiles of these operands (`weight_tiles` weight tiles a K
    step: gate and up, or down) would overflow shared memory, as float32 ones do under a 16-bit table's entry."""
    stage_bytes = cfg.block_k * (cfg.block_m * a.element_size() + weight_tiles * cfg.block_n * w.element_size())
    return common.stages_that_fit(cfg.num_stages, stage_bytes, a.device)


# ------------------------------------------------------------------------------------ tuning table


load_table = common.read_table


def lookup(entries: dict[str, dict], M: int) -> MoEConfig | None:
    """The entry of the smallest bucket holding M, else of the largest bucket."""
    entry = common.bucket_entry(entries, M)
    return None if entry is None else MoEConfig.from_json(entry)


def select_config(num_experts: int, inter: int, hidden: int, M: int, device: torch.device,
                  kind: str = "bf16") -> MoEConfig:
    """A tuned entry for (GPU, E, 2I, H, weight kind) if one was measured (FP8 weights without one of their own
    take the shape's 16-bit entry), else the default table's entry for M = T. `kind`: `moe_small_t.weight_kind`."""
    table = common.gpu_table("fused_moe", device)
    for key_kind in dict.fromkeys((kind, "bf16")):
        cfg = lookup(table.get(moe_small_t.table_key(num_experts, inter, hidden, key_kind), {}), M)
        if cfg is not None:
            return cfg
    cfg = lookup(load_table(DEFAULT_TABLE), M)
    return cfg if cfg is not None else MoEConfig(block_m=64, block_n=64, block_k=64)
