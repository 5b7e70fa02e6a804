"""Decode GEMV for 16-bit and FP8 weights (M <= 8 rows): one launch that reads each weight byte once.

At decode batch sizes a linear layer is a weight stream: the tensor-core GEMM's tiles (64+ rows of the MMA, a
K loop pipelined through shared memory) and, for W8A8, the activation quantizer's own launch cost more than the
bytes. Here the weight `[N, K]` (K contiguous, nn.Linear layout: bfloat16/float16, or float8_e4m3fn with a
per-channel or per-tensor scale) is cut into `[BLOCK_N, BLOCK_K]` slices, one per program, each loaded whole
in a single wide load (every byte of it in flight at once, many programs per SM), converted to fp32 in
registers and multiplied by each of the `M` model-dtype activation rows (unquantized: W8A16 numerics for FP8
weights, more exact than W8A8), reduced over its K slice.

A weight with more than one K slice (`split_k = ceil(K / BLOCK_K)` programs per `BLOCK_N` rows) writes fp32
partial sums to a workspace; the last program to arrive at its rows (an atomic counter, acq_rel) sums the
partials in split order, so the result does not depend on timing, applies the scale and the bias, rounds once
and resets the counter (the counters are left zeroed: graph-safe, one stream).

Numerics, shared by `gemv_ref`: `out = x @ (weight * scale).T + bias` in fp32, rounded once to `out_dtype`.

Which layers take it, and up to which M: the per-GPU table `tuning/gemv_<gpu>.json` (written by
scripts/h200_gemv.py), keyed by the weight's kind ("fp8" or "w16") and `(N, K)`; without an entry the layer keeps
its GEMM (cuBLAS for 16-bit weights, W8A8 for FP8).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels import common
from kestrel.kernels import moe_common as _mc
from kestrel.kernels import moe_routing as _routing

TABLE = "gemv"
MAX_M = 8
_WEIGHT_KINDS = {torch.float8_e4m3fn: "fp8", torch.bfloat16: "w16", torch.float16: "w16"}


@dataclass(frozen=True)
class GemvConfig:
    """One program's weight slice `[block_n, block_k]` and its warps. `max_m`: the GEMV is chosen for
    1 <= M <= max_m (0: never); the tiles apply at any M."""

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    max_m: int = 0

    def to_json(self) -> dict:
        return asdict(self)


DEFAULT = GemvConfig()


def weight_kind(dtype: torch.dtype) -> str | None:
    """The table's name for a weight dtype ("fp8", "w16"), or None for dtypes this kernel does not read."""
    return _WEIGHT_KINDS.get(dtype)


def table_key(kind: str, N: int, K: int) -> str:
    return f"{kind}:{N},{K}"


def table_config(weight: torch.Tensor) -> GemvConfig | None:
    """The GPU table's config for this 2-D weight, or None (no table, no entry, or a dtype it does not read)."""
    kind = weight_kind(weight.dtype)
    if kind is None or weight.dim() != 2:
        return None
    entry = common.gpu_table(TABLE, weight.device).get(table_key(kind, *weight.shape))
    return None if entry is None else GemvConfig(**entry)


def takes_rows(cfg: GemvConfig | None, M: int) -> bool:
    """Whether a layer whose table config is `cfg` runs `M` rows on this path."""
    return cfg is not None and 1 <= M <= min(cfg.max_m, MAX_M)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
           bias: torch.Tensor | None) -> tuple[int, int, int]:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]")
    if weight_kind(weight.dtype) is None:
        raise ValueError(f"gemv: weight must be float8_e4m3fn, bfloat16 or float16, got {weight.dtype}")
    M, K = x.shape
    N = weight.shape[0]
    if (weight.dtype == torch.float8_e4m3fn) != (weight_scale is not None):
        raise ValueError("gemv: a float8_e4m3fn weight needs its weight_scale; a 16-bit weight takes none")
    if weight_scale is not None and weight_scale.numel() not in (1, N):
        raise ValueError(f"gemv: weight_scale has {weight_scale.numel()} elements; expected 1 or N={N}")
    if bias is not None and bias.numel() != N:
        raise ValueError(f"gemv: bias has {bias.numel()} elements; expected N={N}")
    return M, N, K


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, out_dtype: torch.dtype,
             bias: torch.Tensor | None = None, *, config: GemvConfig | None = None) -> torch.Tensor:
    """PyTorch reference in fp32: `x @ (weight * scale).T + bias`, rounded once. `config` is unused."""
    _check(x, weight, weight_scale, bias)
    w = weight.float()
    if weight_scale is not None:
        w = w * weight_scale.float().reshape(-1, 1)
    out = x.float() @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# ------------------------------------------------------------------------------------------- kernel


@triton.jit
def _epilogue(dot, m, cols, rows, n_ok, s_ptr, b_ptr, out_ptr, stride_om,
              HAS_SCALE: tl.constexpr, PER_TENSOR: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr):
    y = dot
    if HAS_SCALE:
        if PER_TENSOR:
            y = y * tl.load(s_ptr)
        else:
            y = y * tl.load(s_ptr + rows)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    tl.store(out_ptr + m * stride_om + cols, common.to_dtype(y, out_ptr.dtype.element_ty, FAST), mask=n_ok)


@triton.jit
def _route_when_last(out_ptr, stride_om, N, done_ptr, route_w_ptr, route_id_ptr, ROWS: tl.constexpr,
                     NUM_BLOCKS: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                     RENORMALIZE: tl.constexpr, SIGMOID: tl.constexpr):
    """After this program stored its column block of every row: the last of the NUM_BLOCKS to arrive routes each
    row from the stored logits (rounded to the output dtype, as the routing launch reads them) and zeroes the
    counter again."""
    if common.last_arrival(done_ptr, NUM_BLOCKS):
        offs = tl.arange(0, E_PAD)
        valid = offs < N
        for m in tl.static_range(ROWS):
            logits = tl.load(out_ptr + m * stride_om + offs, mask=valid, other=float("-inf"), cache_modifier=".cg")
            _routing.topk_of_row(logits.to(tl.float32), offs, valid, route_w_ptr + m * TOP_K,
                                 route_id_ptr + m * TOP_K, TOP_K, K_PAD, E_PAD, RENORMALIZE, SIGMOID)
        tl.atomic_xchg(done_ptr, 0)


@triton.jit(do_not_specialize=["stride_xm", "stride_om"])
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, lock_ptr, route_w_ptr, route_id_ptr, N, K, stride_xm,
                 stride_wn, stride_om, SPLIT_K: tl.constexpr, ROWS: tl.constexpr, W_FP8: tl.constexpr,
                 HAS_SCALE: tl.constexpr, PER_TENSOR: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 USE_PDL: tl.constexpr, FAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_BLOCKS: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                 RENORMALIZE: tl.constexpr, SIGMOID: tl.constexpr):
    """out[m, n] = round(scale[n] * sum_k x[m, k] * w[n, k] + bias[n]) for the ROWS rows of x; this program
    reads the weight slice [BLOCK_N rows, K slice `program_id % SPLIT_K`]. Under PDL the slice is loaded before
    waiting for the previous kernel (weights never depend on it); x, the workspace, the counters and the output
    after. TOP_K > 0 (a router): the last of the NUM_BLOCKS column blocks to be stored also routes each row (its
    counter is the one after the column blocks' own)."""
    if USE_PDL:
        gdc_launch_dependents()
    pid, nb, split, cols, n_ok = common.split_program(N, SPLIT_K, BLOCK_N)
    # Wrapped rows keep the weight loads in bounds without an N mask; their results are not stored.
    rows = (cols % N).to(tl.int64)
    ks = split * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    w_ptrs = w_ptr + rows[:, None] * stride_wn + ks[None, :]
    if EVEN_K:
        w = _mc._load(w_ptrs, None, False, W_FP8).to(tl.float32)
    else:
        w = _mc._load(w_ptrs, k_ok[None, :], True, W_FP8).to(tl.float32)
    if USE_PDL:
        gdc_wait()
    part = ws_ptr + pid.to(tl.int64) * (ROWS * BLOCK_N) + tl.arange(0, BLOCK_N)
    for m in tl.static_range(ROWS):
        if EVEN_K:
            xv = tl.load(x_ptr + m * stride_xm + ks)
        else:
            xv = tl.load(x_ptr + m * stride_xm + ks, mask=k_ok, other=0.0)
        dot = tl.sum(w * xv.to(tl.float32)[None, :], axis=1)
        if SPLIT_K == 1:
            _epilogue(dot, m, cols, rows, n_ok, s_ptr, b_ptr, out_ptr, stride_om,
                      HAS_SCALE, PER_TENSOR, HAS_BIAS, FAST)
        else:
            tl.store(part + m * BLOCK_N, dot)
    if SPLIT_K == 1 and TOP_K > 0:
        _route_when_last(out_ptr, stride_om, N, lock_ptr + NUM_BLOCKS, route_w_ptr, route_id_ptr, ROWS, NUM_BLOCKS,
                         TOP_K, K_PAD, E_PAD, RENORMALIZE, SIGMOID)
    if SPLIT_K > 1:
        is_last = common.last_arrival(lock_ptr + nb, SPLIT_K)
        if is_last:
            for m in tl.static_range(ROWS):
                _epilogue(common.split_row_sum(ws_ptr, nb, m, SPLIT_K, ROWS, BLOCK_N), m, cols, rows, n_ok, s_ptr,
                          b_ptr, out_ptr, stride_om, HAS_SCALE, PER_TENSOR, HAS_BIAS, FAST)
            tl.atomic_xchg(lock_ptr + nb, 0)
            if TOP_K > 0:
                _route_when_last(out_ptr, stride_om, N, lock_ptr + NUM_BLOCKS, route_w_ptr, route_id_ptr, ROWS,
                                 NUM_BLOCKS, TOP_K, K_PAD, E_PAD, RENORMALIZE, SIGMOID)


# ----------------------------------------------------------------------------------------- launcher


def gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, out_dtype: torch.dtype,
         bias: torch.Tensor | None = None, *, config: GemvConfig | None = None) -> torch.Tensor:
    """Triton `gemv_ref`; see the module docstring. Any M works (the slices are sized for a few rows; more than
    `MAX_M` run in chunks). No host sync: capturable in a CUDA graph."""
    M, N, K = _check(x, weight, weight_scale, bias)
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(gemv_ref(x, weight, weight_scale, out_dtype, bias))
    _launch(x, weight, weight_scale, bias, out, config or DEFAULT, None)
    return out


def gemv_route_ref(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, *,
                   config: GemvConfig | None = None, scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [M, k], expert ids int64 [M, k]): the top-k by `scoring` (softmax or sigmoid) of a router's
    logits, `x @ weight.T` rounded to x's dtype (`gemv_ref`, then `moe_routing.route_topk_ref`). `config` is
    unused."""
    return _routing.route_topk_ref(gemv_ref(x, weight, None, x.dtype), top_k, renormalize, scoring)


def gemv_route(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, *,
               config: GemvConfig | None = None, scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `gemv_route_ref` in one launch (per `MAX_M` rows) for a 16-bit router weight: the GEMV's last
    column block to be stored routes every row (`moe_routing.topk_of_row`, the routing launch's code), in place
    of the routing launch after it. Where the `router_topk` launch feature is off: the GEMV, then that launch."""
    if weight.dtype == torch.float8_e4m3fn:
        raise ValueError("gemv_route: the router weight must be 16-bit (routing stays in the model dtype)")
    M, N, K = _check(x, weight, None, None)
    _routing.check_routing(N, top_k, scoring, 1, 1)
    cfg = config or DEFAULT
    # Off (the launch feature, until measured on this GPU), nothing to launch, or no counter left for the
    # router's: the two launches.
    if (not common.launch_feature("router_topk", x.device) or M == 0 or K == 0
            or triton.cdiv(N, cfg.block_n) >= common.ARRIVAL_SLOTS):
        return _routing.route_topk(gemv(x, weight, None, x.dtype, config=cfg), top_k, renormalize, scoring)
    weights = torch.empty(M, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(M, top_k, dtype=torch.int64, device=x.device)
    _launch(x, weight, None, None, torch.empty(M, N, dtype=x.dtype, device=x.device), cfg,
            (weights, ids, renormalize, scoring))
    return weights, ids


def _launch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, bias: torch.Tensor | None,
            out: torch.Tensor, cfg: GemvConfig, route: tuple[torch.Tensor, torch.Tensor, bool, str] | None) -> None:
    """The GEMV launches into `out`; `route` (weights, ids, renormalize, scoring): each row's top-k too."""
    M, N = out.shape
    K = x.shape[1]
    if weight.stride(1) != 1:
        raise ValueError("gemv: weight must be contiguous along K")
    x = x if x.stride(1) == 1 else x.contiguous()
    scale = weight_scale.reshape(-1).float().contiguous() if weight_scale is not None else None
    # The scale, or for a 16-bit weight any pointer: the kernel never reads it, nor the other unused arguments'.
    scale_arg = scale if scale is not None else weight
    b = bias.contiguous() if bias is not None else scale_arg
    block_k = min(cfg.block_k, triton.next_power_of_2(K))
    split_k = triton.cdiv(K, block_k)
    n_blocks = triton.cdiv(N, cfg.block_n)
    # Each column block's split-K counter, and after them the router's (`gemv_route` checked that it fits).
    if split_k > 1 and n_blocks + (route is not None) > common.ARRIVAL_SLOTS:
        block_k, split_k = triton.next_power_of_2(K), 1
    locks = common.arrival_counters(x.device) if split_k > 1 or route is not None else scale_arg
    weights, ids, renormalize, scoring = route if route is not None else (scale_arg, scale_arg, False, "softmax")
    top_k = weights.shape[1] if route is not None else 0
    for m0 in range(0, M, MAX_M):
        xm, om = x[m0:m0 + MAX_M], out[m0:m0 + MAX_M]
        rows = xm.shape[0]
        ws = (torch.empty(n_blocks * split_k * rows * cfg.block_n, dtype=torch.float32, device=x.device)
              if split_k > 1 else scale_arg)
        _gemv_kernel[(n_blocks * split_k,)](
            xm, weight, scale_arg, b, om, ws, locks, weights[m0:m0 + MAX_M] if top_k else weights,
            ids[m0:m0 + MAX_M] if top_k else ids, N, K, xm.stride(0), weight.stride(0), om.stride(0),
            SPLIT_K=split_k, ROWS=rows, W_FP8=weight.dtype == torch.float8_e4m3fn, HAS_SCALE=scale is not None,
            PER_TENSOR=scale is not None and scale.numel() == 1, HAS_BIAS=bias is not None,
            EVEN_K=K % block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=block_k, num_warps=cfg.num_warps,
            # Routing's constants only where it routes: a plain GEMV compiles once for every N, as before.
            NUM_BLOCKS=n_blocks if top_k else 1, TOP_K=top_k, K_PAD=triton.next_power_of_2(max(top_k, 1)),
            E_PAD=triton.next_power_of_2(N) if top_k else 1, RENORMALIZE=renormalize, SIGMOID=scoring == "sigmoid",
            **common.launch_options(x, "pdl_decode"))
