"""Fused mixture-of-experts MLP: every token's top-k experts' gated MLPs, weighted and summed, in three launches
after a device-side routing sort.

`out[t] = sum_j topk_weights[t, j] * w2[e] @ (act(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))`, `e = topk_ids[t, j]`,
with `w13` `[E, 2*I, H]` (gate rows, then up rows: the merged gate_up layout) and `w2` `[E, H, I]`.

Numerics (the reference and the kernel agree on them): both GEMMs accumulate in fp32; `act(gate) * up` is
computed in fp32 and rounded once to x's dtype (the intermediate a model-dtype MLP would hold); each expert's
down output is multiplied by its routing weight in fp32, the k products are summed in fp32 and rounded once.

The Triton path, as vLLM's fused_moe organises it:
1. `moe_align`: the `T*k` (token, slot) pairs sorted by expert, each expert's run padded to a multiple of
   BLOCK_M with a sentinel (`T*k`), one expert id per block, and the padded total on the device. Torch ops
   only, no host sync: it sizes its buffers by the bound `T*k + min(E, T*k) * (BLOCK_M - 1)`, so it can be
   captured in a CUDA graph; programs of blocks past the real total return at once.
2. A grouped GEMM, launched twice. Each program takes one BLOCK_M block of sorted pairs (one expert) and a
   BLOCK_N column slice. First `x @ w13[e]^T` with the gate and up tiles of the same columns accumulated side
   by side, so the epilogue writes `act(gate) * up` `[T*k, I]` directly; then `inter @ w2[e]^T` with the
   routing weight applied in the epilogue, written in fp32 `[T*k, H]` (in x's dtype straight to the output
   when k == 1).
3. A small kernel sums the k rows of each token in fp32 and rounds once.

Block sizes come from a JSON table chosen offline (`tuning/fused_moe_default.json`, by M = T bucket; a
per-GPU `tuning/fused_moe_<gpu>.json` keyed by `E,2I,H` overrides it); nothing autotunes at run time.

Quantized follow-ups (W8A8-FP8, block FP8) fit the same kernel: per-channel scales `[E, N]` (and per-token
activation scales `[T]`, gathered by `pair // top_k` like the x rows) multiply the accumulator in the
epilogue; block scales `[E, N / bn, K / bk]` with BLOCK_K == bk are loaded per K step and applied to each
partial dot product before it is added to the accumulator.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from kestrel.kernels import activation as _activation
from kestrel.kernels import common

TUNING_DIR = Path(__file__).parent / "tuning"
DEFAULT_TABLE = TUNING_DIR / "fused_moe_default.json"
_SUM_BLOCK = 1024  # hidden columns per program of the k-sum


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
) -> torch.Tensor:
    """PyTorch reference and the CPU path: one pair of matmuls per expert over the tokens routed to it."""
    T, H, E, inter, k = _check_args(x, w13, w2, topk_weights, topk_ids)
    _activation.activation_code(activation)
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    if T == 0:
        return out.to(x.dtype)
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    tokens = order // k
    weights = topk_weights.reshape(-1).float()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        gate_up = x.index_select(0, rows).float() @ w13[e].float().T
        act = _activation.activate_ref(gate_up[:, :inter], activation) * gate_up[:, inter:]
        down = act.to(x.dtype).float() @ w2[e].float().T
        out.index_add_(0, rows, down * weights[start:start + n, None])
        start += n
    return out.to(x.dtype)


def _check_args(x, w13, w2, topk_weights, topk_ids) -> tuple[int, int, int, int, int]:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe: x [T, H], w13 [E, 2I, H], w2 [E, H, I] expected, got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    T, H = x.shape
    E, two_i, H13 = w13.shape
    inter = two_i // 2
    if H13 != H or two_i % 2 or tuple(w2.shape) != (E, H, inter):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}"
                         f" (w13 [E, 2I, H], w2 [E, H, I])")
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
        raise ValueError(f"fused_moe: x, w13, w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"fused_moe: topk_weights and topk_ids [T, k] expected with T={T}, got "
                         f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    return T, H, E, inter, topk_ids.shape[1]


# ------------------------------------------------------------------------------------------- routing


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs `p = t * k + j` grouped by expert, each expert's run padded to a multiple of `block_m`.

    Returns `sorted_ids` int32 `[num_blocks * block_m]` (pair indices; `T*k` marks padding), `expert_ids`
    int32 `[num_blocks]` (the expert of each block; blocks past the real total repeat the last expert) and
    `num_padded` int32 `[1]` (the real padded total). `num_blocks` bounds the real count from above and
    depends on shapes only. Pairs keep their order within an expert (a stable sort). Ids must lie in
    [0, num_experts).
    """
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    device = flat.device
    num_blocks = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m)
    sorted_e, order = torch.sort(flat, stable=True)
    # Run boundaries by binary search rather than bincount: bincount sizes its output on the host.
    bounds = torch.searchsorted(sorted_e, torch.arange(num_experts + 1, dtype=flat.dtype, device=device))
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    dest = padded_start[sorted_e] + (torch.arange(n, device=device) - bounds[sorted_e])
    sorted_ids = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, num_blocks * block_m, block_m, device=device, dtype=padded_end.dtype)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), padded_end[-1:].to(torch.int32)


# ------------------------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs, num_blocks, N, K, top_k,
    stride_am, stride_we, stride_wn, stride_wk, stride_om,
    ACT_MUL: tl.constexpr, ACTIVATION: tl.constexpr, MUL_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr, FAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[p, n] = epilogue(sum_k a[p // top_k, k] * w[e, n, k]) for the BLOCK_M pairs p of one block.
    ACT_MUL: w holds gate rows [0, N) and up rows [N, 2N); the epilogue is act(gate) * up."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return

    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    # Wrapped column indices keep the weight loads in bounds without a mask; their results are not stored.
    w_cols = (cols % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // top_k).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + w_cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ACT_MUL:
        up_ptrs = w_ptrs + N * stride_wn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if DOT_F32:
            # fp32 dots: the interpreter multiplies bf16 blocks wrongly (numpy has no bf16); fp32 models want ieee.
            a = a.to(tl.float32)
            acc = tl.dot(a, w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        if ACT_MUL:
            if EVEN_K:
                u = tl.load(up_ptrs)
            else:
                u = tl.load(up_ptrs, mask=k_ok[:, None], other=0.0)
            if DOT_F32:
                acc_up = tl.dot(a, u.to(tl.float32), acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, u, acc_up)
            up_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    if ACT_MUL:
        acc = _activation.activate(acc, ACTIVATION) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out = common.to_dtype(acc, out_ptr.dtype.element_ty, FAST)
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :], out,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_sum_kernel(in_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """out[t] = sum_j in[t * TOP_K + j] in fp32 (j in order), rounded once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(in_ptr + (t * TOP_K + j) * H + cols, mask=mask, other=0.0)
    tl.store(out_ptr + t * H + cols, common.to_dtype(acc, out_ptr.dtype.element_ty, FAST), mask=mask)


# ----------------------------------------------------------------------------------------- launcher


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    *,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """Triton `fused_moe_ref`; see the module docstring. `config` overrides the tuning table (tests, tuning).
    No host sync: capturable in a CUDA graph."""
    T, H, E, inter, k = _check_args(x, w13, w2, topk_weights, topk_ids)
    code = _activation.activation_code(activation)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    cfg = config or select_config(E, inter, H, T, x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    num_pairs = T * k
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, E, cfg.block_m)
    num_blocks = expert_ids.numel()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    common_args = dict(DOT_F32=not x.is_cuda or x.dtype == torch.float32, FAST=x.is_cuda,
                       BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _moe_gemm_kernel[(num_blocks * triton.cdiv(inter, cfg.block_n),)](
        x, w13, act, weights, sorted_ids, expert_ids, num_padded,
        num_pairs, num_blocks, inter, H, k,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        ACT_MUL=True, ACTIVATION=code, MUL_WEIGHT=False, EVEN_K=H % cfg.block_k == 0, **common_args,
    )
    # k == 1: each token's one product is the output, rounded once in the epilogue.
    down = out if k == 1 else torch.empty(num_pairs, H, dtype=torch.float32, device=x.device)
    _moe_gemm_kernel[(num_blocks * triton.cdiv(H, cfg.block_n),)](
        act, w2, down, weights, sorted_ids, expert_ids, num_padded,
        num_pairs, num_blocks, H, inter, 1,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), down.stride(0),
        ACT_MUL=False, ACTIVATION=code, MUL_WEIGHT=True, EVEN_K=inter % cfg.block_k == 0, **common_args,
    )
    if k > 1:
        block = min(_SUM_BLOCK, triton.next_power_of_2(H))
        _moe_sum_kernel[(T, triton.cdiv(H, block))](down, out, H, TOP_K=k, BLOCK=block, FAST=x.is_cuda,
                                                      num_warps=4 if block >= 512 else 1)
    return out


# ------------------------------------------------------------------------------------ tuning table


@functools.cache
def load_table(path: Path) -> dict:
    if not path.exists():
        return {}
    return json.loads(path.read_text()).get("configs", {})


def gpu_table_path(gpu_name: str) -> Path:
    key = "".join(ch if ch.isalnum() else "_" for ch in gpu_name.lower()).strip("_")
    return TUNING_DIR / f"fused_moe_{key}.json"


@functools.cache
def _device_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def lookup(entries: dict[str, dict], M: int) -> MoEConfig | None:
    """The entry of the smallest bucket holding M, else of the largest bucket."""
    if not entries:
        return None
    buckets = sorted(int(b) for b in entries)
    fit = [b for b in buckets if b >= M]
    return MoEConfig.from_json(entries[str(fit[0] if fit else buckets[-1])])


def select_config(num_experts: int, inter: int, hidden: int, M: int, device: torch.device) -> MoEConfig:
    """A tuned entry for (GPU, E, 2I, H) if one was measured, else the default table's entry for M = T."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        tuned = load_table(gpu_table_path(_device_name(index))).get(f"{num_experts},{2 * inter},{hidden}", {})
        cfg = lookup(tuned, M)
        if cfg is not None:
            return cfg
    cfg = lookup(load_table(DEFAULT_TABLE), M)
    return cfg if cfg is not None else MoEConfig(block_m=64, block_n=64, block_k=64)
