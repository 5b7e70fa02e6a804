"""Helpers shared by the elementwise kernels: nearest-even rounding that Triton's interpreter gets right, the
merge of split attention partials, and the programmatic-dependent-launch options.

On the GPU (`FAST`) the hardware conversions round to nearest even. Triton's CPU interpreter truncates
fp32 -> bf16 and drops the mantissa carry in fp32 -> e4m3, so off the GPU the kernels round by hand to an
exactly representable fp32 value first; then both paths agree bit for bit.

Kernels call these through the module (`common.to_dtype(...)`), never through a name imported into their own
module: the kernel tests reload modules in interpreter mode in import order, and a name bound before that
reload would still hold the compiled function.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

FP8_E4M3_MAX = 448.0


@triton.jit
def rint(y):
    """Round half to even (libdevice.rint has no interpreter implementation)."""
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def round_e4m3(v):
    """Nearest-even e4m3 grid point of v in [-448, 448], as fp32."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = rint(a * 512.0) * 0.001953125  # below 2^-6 the e4m3 grid step is 2^-9
    r = tl.where(a < 0.015625, subnormal, normal)
    return tl.where(v < 0, -r, r)


@triton.jit
def round_bf16(x):
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_dtype(h, dtype: tl.constexpr, FAST: tl.constexpr):
    """Round fp32 to `dtype` (nearest even): the GPU's cast, or by hand for the interpreter's bf16."""
    if dtype == tl.bfloat16 and not FAST:
        h = round_bf16(h)
    return h.to(dtype)


@triton.jit
def to_cache(x, scale, dtype: tl.constexpr, FP8: tl.constexpr, FAST: tl.constexpr):
    """fp32 `x` as stored in a KV cache of `dtype`: an FP8 cache holds x / scale saturated to +-448."""
    if FP8:
        y = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
        if not FAST:
            y = round_e4m3(y)
        return y.to(dtype)
    return to_dtype(x, dtype, FAST)


@triton.jit
def merge_splits(plse_ptr, po_ptr, row, s_ok, offs_d, HEAD_PAD: tl.constexpr):
    """One output row from the partials of its splits (`row` the splits' packed rows, `s_ok` the real ones):
    each `[HEAD_PAD]` partial weighted by 2^(its base-2 log-sum-exp - the largest), in fp32. A split that saw no
    key (lse -inf) weighs 0; a row whose splits saw none merges to 0."""
    lse = tl.load(plse_ptr + row, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.math.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    partial = tl.load(po_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    total = tl.sum(weight, 0)
    return tl.sum(weight[:, None] * partial, 0) / tl.where(total == 0.0, 1.0, total)


def pdl_options(x: torch.Tensor, feature: str | None = None) -> dict:
    """The `USE_PDL` constexpr plus the launch's PDL flag: overlap with the previous kernel's tail. A kernel
    launched so calls `gdc_wait` before it reads what an earlier kernel wrote or writes any memory, on every path
    (an earlier kernel's completion is only guaranteed to the kernels after it through those waits). `feature`:
    the `launch_feature` that must be on as well."""
    pdl = x.is_cuda and is_hopper_or_newer(x.device) and (feature is None or launch_feature(feature, x.device))
    return {"USE_PDL": pdl, "launch_pdl": pdl} if x.is_cuda else {"USE_PDL": False}


def launch_options(x: torch.Tensor, feature: str | None = None) -> dict:
    """`pdl_options` plus the `FAST` constexpr (the GPU's own roundings and conversions)."""
    return {"FAST": x.is_cuda, **pdl_options(x, feature)}


@functools.cache
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def is_hopper_or_newer(device: torch.device) -> bool:
    """Programmatic dependent launch, TMA and bulk L2 prefetch need sm_90."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability_major(index) >= 9


@functools.cache
def _num_sms_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device, off_cuda: int) -> int:
    """Multiprocessors of a CUDA device; `off_cuda` elsewhere (the interpreter), chosen by each caller."""
    if device.type != "cuda":
        return off_cuda
    return _num_sms_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _max_shared_bytes(device_index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def stages_that_fit(num_stages: int, stage_bytes: int, device: torch.device) -> int:
    """The most pipeline stages, up to `num_stages`, whose operand tiles (`stage_bytes` a stage) fit the device's
    shared memory. A table tuned for 16-bit operands can ask more than a GPU has for 32-bit ones; off CUDA
    (the interpreter) `num_stages` as asked."""
    if device.type != "cuda":
        return num_stages
    # The epilogue's scratch reuses the pipeline's buffers, so the operand tiles alone must fit.
    budget = _max_shared_bytes(device.index if device.index is not None else torch.cuda.current_device())
    while num_stages > 1 and num_stages * stage_bytes > budget:
        num_stages -= 1
    return num_stages


# ------------------------------------------------------------------------- split-K arrival counters

@triton.jit
def split_program(N, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A split-K GEMV program's place: (program id, its column block, its K split, the block's columns, which of
    them lie inside N). Programs run split-major within a column block, so a block's splits are neighbours."""
    pid = tl.program_id(0)
    nb = pid // SPLIT_K
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid, nb, pid % SPLIT_K, cols, cols < N


@triton.jit
def last_arrival(lock, count):
    """After this program stored what the others will read (split-K partials, split-KV partials, k products):
    whether it is the last of the `count` programs to arrive at `lock` (acq_rel, so it sees what every other
    program stored)."""
    tl.debug_barrier()
    return tl.atomic_add(lock, 1, sem="acq_rel") == count - 1


@triton.jit
def split_row_sum(ws_ptr, nb, m, SPLIT_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row m of column block nb summed over its SPLIT_K fp32 partials in split order (deterministic), from a
    workspace laid out [column block, split, row, BLOCK_N]."""
    first = ws_ptr + (nb * SPLIT_K).to(tl.int64) * (ROWS * BLOCK_N) + m * BLOCK_N + tl.arange(0, BLOCK_N)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(SPLIT_K):
        total += tl.load(first + s * (ROWS * BLOCK_N), cache_modifier=".cg")
    return total


@triton.jit
def gemm_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """A split-K GEMM program's place, launched on (tiles, splits): (its output tile, its K split, the tile's rows,
    its columns), GROUP_M row blocks sweeping the column blocks together (each weight tile then serves GROUP_M row
    blocks from L2)."""
    tile = tl.program_id(0)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (tile // per_group) * GROUP_M
    group_size = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_size
    pid_n = (tile % per_group) // group_size
    return (tile, tl.program_id(1), pid_m * BLOCK_M + tl.arange(0, BLOCK_M),
            pid_n * BLOCK_N + tl.arange(0, BLOCK_N))


@triton.jit
def finish_tile(acc, out_ptr, bias_ptr, ws_ptr, lock_ptr, tile, split, split_k, rows, cols, M, N, stride_om,
                SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """A GEMM tile's fp32 `acc` written out (`store_tile`); under SPLIT it is one K split's partial: stored to the
    workspace ([tile, split, BLOCK_M, BLOCK_N], the real rows only), and the last split to arrive sums every
    partial in split order (deterministic), writes the tile and leaves its counter zeroed."""
    if SPLIT:
        live = (rows < M)[:, None]
        tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_base = tile.to(tl.int64) * split_k * (BLOCK_M * BLOCK_N)
        tl.store(ws_ptr + tile_base + split * (BLOCK_M * BLOCK_N) + tile_offs, acc, mask=live)
        if last_arrival(lock_ptr + tile, split_k):
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s_idx in range(0, split_k):
                total += tl.load(ws_ptr + tile_base + s_idx * (BLOCK_M * BLOCK_N) + tile_offs, mask=live,
                                 other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(lock_ptr + tile, 0)
            store_tile(total, out_ptr, bias_ptr, rows, cols, M, N, stride_om, HAS_BIAS, FAST)
    else:
        store_tile(acc, out_ptr, bias_ptr, rows, cols, M, N, stride_om, HAS_BIAS, FAST)


@triton.jit
def store_tile(acc, out_ptr, bias_ptr, rows, cols, M, N, stride_om, HAS_BIAS: tl.constexpr, FAST: tl.constexpr):
    """A GEMM tile plus its columns' bias, in the output's dtype, inside [M, N]."""
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(ptrs, to_dtype(acc, out_ptr.dtype.element_ty, FAST), mask=(rows < M)[:, None] & (cols < N)[None, :])


# An e4m3 tensor-core dot (wgmma, mma) reduces over at least 32: the least K of any FP8 dot a launch asks for.
FP8_DOT_MIN_K = 32

# Counters one launch can use: its tiles (or row blocks) whose K splits meet in the last program to arrive.
ARRIVAL_SLOTS = 1 << 16
_arrival_counters: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 split-K arrival counters (ARRIVAL_SLOTS of them), one buffer per device shared by every
    kernel that counts arrivals (scaled_mm, wna16, gemv, wna16_gemv): each launch leaves the counters it used
    zeroed again, so consecutive launches on one stream can all use it (concurrent streams would need their own)."""
    buf = _arrival_counters.get(device)
    if buf is None:
        buf = torch.zeros(ARRIVAL_SLOTS, dtype=torch.int32, device=device)
        _arrival_counters[device] = buf
    return buf


# ------------------------------------------------------------------------------------ tuning tables

TUNING_DIR = Path(__file__).parent / "tuning"


@functools.cache
def read_table(path: Path) -> dict:
    """The `configs` of a tuning table (JSON), or {} where there is none."""
    if not path.exists():
        return {}
    return json.loads(path.read_text()).get("configs", {})


@functools.cache
def device_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def gpu_key(name: str) -> str:
    """A GPU's name as the tuning tables' file names spell it ("NVIDIA H200" -> "nvidia_h200")."""
    return "".join(ch if ch.isalnum() else "_" for ch in name.lower()).strip("_")


def gpu_table(kernel: str, device: torch.device) -> dict:
    """The configs tuned for this device's GPU (`tuning/<kernel>_<gpu>.json`); {} off CUDA or untuned."""
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return read_table(TUNING_DIR / f"{kernel}_{gpu_key(device_name(index))}.json")


# Launch-shape changes of the decode path (and one of the prefill attention), each off on a GPU until measured there
# (the full-load run under it included): `tuning/decode_launches_<gpu>.json` names those that are on. Off CUDA (the
# interpreter, which only the tests run) every one is on, so the tests cover them.
LAUNCH_FEATURES = (
    "pdl_decode",  # PDL for the decode GEMVs, attention, MoE routing, small-T and grouped MoE GEMMs, the k-sum
    "attention_split_merge",  # the split-KV merge in the last split to arrive; chosen splits a ceiling
    "rope_head_norms",  # per-head q/k RMSNorms inside rope_store_kv
    "moe_k_sum",  # the small-T split down launch's k-sum in its last program to arrive
    "router_topk",  # the MoE router's softmax top-k in its GEMV's last column block to be stored
    "prefill_new_kv",  # the prefill attention launch reads the step's own K/V staged in token order, through TMA
    "prefill_fp8_dots",  # over an FP8 cache, that launch's staged keys run their dots in FP8 (e4m3 q, K, P, V)
    "fp8_dots_scores_in_exp",  # those dots' raw scores scaled inside the exponent's FMA, no multiply per score
    "gated_gemm",  # the W8A8-FP8 gate/up GEMM writes act(gate) * up from its epilogue (steps over 64 rows)
    "wna16_grouped_layout",  # a 4-bit GEMV slice spanning several groups: warps along the columns (`w4_layout`)
    "wna16_int8_wide",  # the int8 GEMV in its own slices, each byte made fp32 by a byte permute (`int8_layout`)
    "wna16_dense_prompts",  # weight-only products of a prompt's rows: the weight written out dense, then cuBLAS
)


def launch_feature(name: str, device: torch.device) -> bool:
    """Whether the decode-path launch change `name` (one of LAUNCH_FEATURES) is on for this device."""
    if name not in LAUNCH_FEATURES:
        raise ValueError(f"unknown launch feature {name!r}; known: {', '.join(LAUNCH_FEATURES)}")
    if device.type != "cuda":
        return True
    return name in _features_on(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _features_on(device_index: int) -> frozenset[str]:
    """The launch features a GPU's table turns on (read once: eager steps ask at every launch)."""
    table = gpu_table("decode_launches", torch.device("cuda", device_index))
    return frozenset(name for name in LAUNCH_FEATURES if table.get(name) is True)


def bucket_entry(entries: dict[str, dict], M: int) -> dict | None:
    """The entry of the smallest M bucket holding M, else of the largest bucket; None for no entries."""
    if not entries:
        return None
    buckets = sorted(int(b) for b in entries)
    fit = [b for b in buckets if b >= M]
    return entries[str(fit[0] if fit else buckets[-1])]

