"""Weight-only GEMM with 4- or 8-bit weights and 16-bit (or fp32) activations: W4A16 / W8A16.

`out[m, n] = sum_k x[m, k] * w[n, k] + bias[n]`, where `w[n, k] = s[g(k), n] * (v[k, n] - z[g(k), n])`, or
`s[g(k), n] * v[k, n] - m[g(k), n]` with float offsets ("mins"), computed in fp32 and rounded once to `out_dtype`.
The weights come from GPTQ, AWQ, compressed-tensors and GGUF checkpoints; the `repack_*` functions below turn each
checkpoint layout into the one layout the kernel reads (`WNA16Weight`).

Weight types (`weight_type`): the value `v` of a stored code or element, and the zero point `z`:
- "int4"      4-bit code c, v = c - 8 (GPTQ symmetric, compressed-tensors symmetric INT4); no zeros.
- "uint4"     4-bit code c, v = c, z from `zeros` (GPTQ asymmetric, AWQ, compressed-tensors asymmetric INT4).
- "fp4_e2m1"  4-bit code c: sign bit 3, exponent bits 2-1, mantissa bit 0: v in {0, 0.5, 1, 1.5, 2, 3, 4, 6} with
              its sign (OCP MX / NVFP4 elements; their block scales folded into `scales` by the loader); no zeros.
- "nf4"       4-bit code c, v = NF4_VALUES[c]: bitsandbytes' NormalFloat4 code book (normal quantiles in [-1, 1],
              not an affine code); no zeros.
- "fp4_bnb"   4-bit code c, v = FP4_BNB_VALUES[c]: bitsandbytes' FP4 (sign bit 3, exponent bits 2-1 with bias 2,
              mantissa bit 0; values up to 12 normalized to 1, so unlike e2m1); no zeros.
- "int8"      int8 element q, v = q, z from `zeros` if given (else 0) (GPTQ 8-bit: the uint8 code minus 128;
              compressed-tensors 8-bit pack-quantized or naive int8).
- "fp8_e4m3"  float8_e4m3fn element (W8A16-FP8, per-channel scales); no zeros.

The packed layout (`WNA16Weight`), K-major with N contiguous (the transpose of the `[N, K]` convention):
- `qweight`: 4-bit types: int32 `[K // 8, N]`, word `(j, n)` holds the codes of rows k = 8j .. 8j+7 at bits
  4 * (k - 8j) (GPTQ's own layout). 8-bit types: int8 or float8_e4m3fn `[K, N]`.
  Why K-packed, N-contiguous: a weight tile `[BLOCK_K, BLOCK_N]` is `BLOCK_K / 8` rows of `4 * BLOCK_N` contiguous
  bytes (256 B for BLOCK_N = 64): full-sector, coalesced loads with no gather; one word unpacks into eight K rows
  of one column (shifts only, no shuffles across columns), so the dot's K operand is built in registers; the
  per-group scale and zero rows are `[BLOCK_N]` contiguous loads; and GPTQ checkpoints (the most common) need no
  bit shuffling at load. (Marlin-style fragment-ordered layouts are faster still; this is the simple first step.)
- `scales`: `[K // group, N]` float (bf16 / fp16 / fp32, kept as the checkpoint stores them), row g for the rows
  k with k // group == g. `group` = K // scales.shape[0]: 16, 32, 64, 128, ... or K (per channel).
- `zeros`: None or int8 `[K // group, N]` (uint4: 0..15; int8: the zero in the signed domain); or float32
  `[K // group, N]` offsets m ("mins", int4 and int8 only: w = s * v - m), the form of llama.cpp's K-quants and
  Q4_1 / Q5_1 (a 6-bit scale and a 6-bit min per sub-block), whose zero points s / m are not integers. The kernel
  takes them out of the main loop's products: each K step adds s * sum x * v as before and subtracts
  m * sum x (the step's activations summed once per row), so the dots keep their exact integer operands.
- `perm`: None or int32 `[K]`: act-order (GPTQ desc_act, compressed-tensors actorder=group). The rows were sorted
  by group at load, so sorted row k holds checkpoint input column perm[k] and every group is a contiguous run of
  rows; at run time x's columns are gathered with the same permutation (`x.index_select(1, perm)`, one small
  launch, capturable) so the main loop only ever sees contiguous groups.

The kernel (one launch, plus the gather for act-order): each program owns a BLOCK_M x BLOCK_N output tile and one
K range (split-K), and walks it in one flat loop (so Triton software-pipelines the tile loads). BLOCK_K divides the
group size, so each K step lies in one group: the step's product is formed from exact operands (values minus zero
points are small integers, fp4 values are doubled into integers, fp8 values are exact: all exact in bf16 / fp16)
with fp32 accumulation, then multiplied by that group's scales in fp32 and added to the tile accumulator; per
channel (one group) the scales are applied once after the loop. So the kernel and the fp32 reference differ only by
summation order. The one exception is nf4 with 16-bit activations on the tensor cores: its code values are not exact
in 16 bits, so the tensor-core dot takes them rounded to the activation dtype (relative 2^-9 in bf16), as
bitsandbytes' own dequantization to the model dtype does; fp32 activations, the FMA path and the interpreter keep
them exact. fp4_bnb values are integers / 192, exact like e2m1's.

`block_m = 1` selects the FMA path (decode-sized M, one activation row per program): no tensor-core dot, so no
register relayout of each weight tile; each K step's products join a `[BLOCK_K, BLOCK_N]` fp32 accumulator
elementwise and are summed over K once after the loop. 4-bit codes become fp32 through their exponent bits
(2^23 + c, minus 2^23 + zero), not a conversion instruction. On the H200 at M = 1 it runs the Llama-3-8B shapes at
1.44-1.76x cuBLAS BF16 where the tensor-core tiles ran at 1.09-1.28x (benchmarks/results/issue28/).

Variants for decode-sized M, each a `WNA16Config` switch (off by default; `scripts/h200_wna16_sweep.py` measures
them and writes a candidate table): `fast_convert` (nibble dots or swap_ab, int4 / uint4 with 16-bit activations,
compiled): whole words become bf16 / fp16 operands in PTX, two nibbles per lop3 into a magic number's mantissa and
one paired fma subtracting magic + zero point, about 1.4 instructions per value instead of about 4 through fp32; the
values (c - z, integers of magnitude <= 15) are exact, so nothing about the rounding changes, and the interpreter
and the other types take the portable conversion. `swap_ab` (block_m >= 16): out^T = W^T x^T, so the weights fill
the tensor cores' 64-row side (Hopper's wgmma can take that operand from registers) and x, padded to
block_m, is the small second operand; with nibble_dots eight dots per K step, else one over the transposed tile
(fast_convert's eight outputs interleaved back into K order); the same exact products, summed in fp32.
`fma_pipeline` (FMA path, 4-bit): Triton pipelines the loads of loops that feed a dot, and this loop has none, so
each step's words arrived only when asked for; 1 loads the next step's words into registers before the current
step's arithmetic, 2 asks `tl.range` for num_stages. Same arithmetic.

`oneshot` (block_m = 1, int4 / uint4, and int8 in groups of 16 or 32 without integer zero points): `kernels/
wna16_gemv.py`, one word slice per program loaded whole and each nibble turned into fp32 by one lop3 (int8: a slice
of half the rows, the same bytes, each value converted, or for one row its own slices under a launch feature); the
H200 table takes it for one row.

Split-K partials meet in an fp32 workspace; the last program to arrive at a tile (an atomic
counter) sums them in split order (deterministic, so CUDA-graph replays are bit-exact) and runs the epilogue
(bias, one rounding).

Block sizes come from `tuning/wna16_default.json` by M bucket (the smallest bucket >= M), overridden by a per-GPU
`tuning/wna16_<gpu>.json` keyed by "N,K"; nothing autotunes at run time. `split_k = 0` in a table means "from the
SM count": enough K splits to give the GPU about two programs per SM when the tiles alone are too few.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kestrel.kernels import common, wna16_dequant, wna16_gemv, wna16_tc
from kestrel.kernels.nibbles import in_k_order, nibbles16
from kestrel.kernels.wna16_gemv import has_mins

DEFAULT_TABLE = common.TUNING_DIR / "wna16_default.json"

WEIGHT_TYPES = ("int4", "uint4", "fp4_e2m1", "nf4", "fp4_bnb", "int8", "fp8_e4m3")
_CODE = {name: i for i, name in enumerate(WEIGHT_TYPES)}  # WTYPE constexpr of the kernel
# The kernel's branches on WTYPE: codes <= _FP4_BNB are the 4-bit packed types, then int8, then fp8.
_FP4 = tl.constexpr(_CODE["fp4_e2m1"])
_NF4 = tl.constexpr(_CODE["nf4"])
_FP4_BNB = tl.constexpr(_CODE["fp4_bnb"])
_INT8 = tl.constexpr(_CODE["int8"])
_FOUR_BIT = ("int4", "uint4", "fp4_e2m1", "nf4", "fp4_bnb")
MINS_TYPES = ("int4", "int8")  # the weight types that take float offsets (mins) in `zeros`
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The e2m1 code book: code c -> value (sign bit 3).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# bitsandbytes' NF4 code book (QLoRA's NormalFloat4, as float32 values), code c -> value; `_nf4_value` in the
# kernel holds the same numbers.
NF4_VALUES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
# bitsandbytes' FP4 code book, code c -> value: magnitudes m / 192 with m = 0, 1, 128, 192, 64, 96, 32, 48 for
# codes 0-7 (its table 0, 0.0625, 8, 12, 4, 6, 2, 3 divided by 12), code 8 + c the negative.
_FP4_BNB_M = (0, 1, 128, 192, 64, 96, 32, 48)
FP4_BNB_VALUES = tuple(m / 192 for m in _FP4_BNB_M) + tuple(-m / 192 for m in _FP4_BNB_M)
# The kernel's integer stand-ins for code values, and the factor its scales take back (fp4_e2m1: twice the value).
_SCALE_MULT = {"fp4_e2m1": 0.5, "fp4_bnb": 1.0 / 192}
_CODE_BOOKS = {"fp4_e2m1": FP4_E2M1_VALUES, "nf4": NF4_VALUES, "fp4_bnb": FP4_BNB_VALUES}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of a word holds column 8j + AWQ_ORDER[i]


class WNA16Weight(NamedTuple):
    """A weight in the kernel's layout (see the module docstring). Its fields, in order, are the arguments of
    `wna16_gemm` after x: `wna16_gemm(x, *w, out_dtype)`."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    perm: torch.Tensor | None
    weight_type: str


@dataclass(frozen=True)
class WNA16Config:
    """Launch parameters. `block_k` is lowered to the largest power of two dividing the group size (under `oneshot`:
    see there); `split_k` 0 picks the split from the SM count (see `split_for`)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8  # row tiles that sweep the column tiles together (weight tiles reused through L2)
    num_warps: int = 4
    num_stages: int = 3
    # 4-bit types with block_k >= 128: eight dots per K step, one per nibble of the packed words, against x's
    # columns k = 8j + s (strided loads of a few activation rows), instead of unpacking the words into a
    # [BLOCK_K, BLOCK_N] tile through a register shuffle.
    nibble_dots: bool = False
    # With nibble_dots or swap_ab: int4 / uint4 codes become bf16 / fp16 operands by bit tricks on whole words
    # (`nibbles.nibble_asm`: about 1.4 instructions per value instead of about 4 through fp32); exact, as before.
    fast_convert: bool = False
    # block_m >= 16: out^T = W^T x^T, the weights as the dots' first operand (the 64-row side of the tensor
    # cores), x padded to block_m as the second; with nibble_dots eight dots per step, else one over the
    # transposed tile.
    swap_ab: bool = False
    # block_m = 1 (the FMA path), 4-bit types: 0 a plain loop, 1 register prefetch of the next step's words,
    # 2 the loop pipelined by Triton with num_stages (see `_gemv_range`).
    fma_pipeline: int = 0
    # block_m = 1, int4 / uint4 (int8 in small groups): the one-shot decode GEMV (`kernels/wna16_gemv.py`), not the
    # FMA path: one [block_k / 8, block_n] word slice per program, codes turned to fp32 by one mask-or each. It
    # reads block_n, block_k (which may then span whole groups; the split is K / block_k) and num_warps only.
    oneshot: bool = False
    # block_m >= 16, int4 / uint4 in groups of block_k (>= 128) or per channel, 16-bit activations: the weights
    # scaled in 16-bit before one chained accumulator (`kernels/wna16_tc.py`), each rounded once as the dense
    # path rounds it, instead of exact codes scaled per K step in fp32. Reads block_m/n/k, split_k, group_m,
    # num_warps, num_stages and swap_ab.
    prescale: bool = False
    # The weight written out dense in one pass, then cuBLAS (`kernels/wna16_dequant.py`; int4 / uint4 / int8 / fp8_e4m3,
    # results in x's dtype): for rows enough to hide the extra pass. Where it does not apply, the looped tiles run
    # with this entry's blocks.
    dense: bool = False

    def __post_init__(self) -> None:
        if self.oneshot and self.block_m != 1:
            raise ValueError(f"WNA16Config: oneshot is a one-row path and needs block_m = 1, got {self.block_m}")

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> WNA16Config:
        return WNA16Config(**d)


# ------------------------------------------------------------------------------------- argument checks


def weight_shape(qweight: torch.Tensor, weight_type: str) -> tuple[int, int]:
    """(K, N) of a packed weight."""
    rows, N = qweight.shape
    return (rows * 8 if weight_type in _FOUR_BIT else rows), N


def _check_weight(qweight, scales, zeros, perm, weight_type) -> tuple[int, int, int]:
    """(K, N, group) after checking a `WNA16Weight`'s fields against each other."""
    if weight_type not in _CODE:
        raise ValueError(f"wna16: weight_type must be one of {WEIGHT_TYPES}, got {weight_type!r}")
    want = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}.get(weight_type, torch.int32)
    if qweight.dim() != 2 or qweight.dtype != want:
        raise ValueError(f"wna16: {weight_type} qweight must be a 2-D {want} tensor, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    K, N = weight_shape(qweight, weight_type)
    if scales.dim() != 2 or scales.shape[1] != N or scales.shape[0] < 1 or K % scales.shape[0]:
        raise ValueError(f"wna16: scales must be [K // group, N] with N={N} and K={K} a multiple of its rows, got "
                         f"{tuple(scales.shape)}")
    if scales.dtype not in _ACT_DTYPES:
        raise ValueError(f"wna16: scales must be bfloat16, float16 or float32, got {scales.dtype}")
    group = K // scales.shape[0]
    if group % 16:
        raise ValueError(f"wna16: the group size (K // scales rows = {group}) must be a multiple of 16")
    if weight_type == "uint4" and zeros is None:
        raise ValueError("wna16: uint4 weights need zeros (use int4 for the symmetric code - 8)")
    if has_mins(zeros):
        if weight_type not in MINS_TYPES:
            raise ValueError(f"wna16: float offsets (mins) are for {MINS_TYPES} weights, not {weight_type}")
        if zeros.dtype != torch.float32 or tuple(zeros.shape) != tuple(scales.shape):
            raise ValueError(f"wna16: mins must be float32 {tuple(scales.shape)}, got {zeros.dtype} "
                             f"{tuple(zeros.shape)}")
    elif zeros is not None:
        if weight_type not in ("uint4", "int8"):
            raise ValueError(f"wna16: zero points are for uint4 and int8 weights, not {weight_type}")
        if zeros.dtype != torch.int8 or tuple(zeros.shape) != tuple(scales.shape):
            raise ValueError(f"wna16: zeros must be int8 {tuple(scales.shape)}, got {zeros.dtype} "
                             f"{tuple(zeros.shape)}")
    if perm is not None and (perm.dim() != 1 or perm.numel() != K or perm.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"wna16: perm must be an int32 or int64 [K={K}] tensor")
    return K, N, group


def check_args(x, qweight, scales, zeros, perm, weight_type, out_dtype, bias) -> tuple[int, int, int]:
    K, N, group = _check_weight(qweight, scales, zeros, perm, weight_type)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"wna16: x must be [M, K={K}], got {tuple(x.shape)}")
    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"wna16: x must be bfloat16, float16 or float32, got {x.dtype}")
    if out_dtype not in _ACT_DTYPES:
        raise ValueError(f"wna16: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if bias is not None and bias.numel() != N:
        raise ValueError(f"wna16: bias must have N={N} elements, got {bias.numel()}")
    return K, N, group


# ------------------------------------------------------------------------------------------- reference


def unpack_values(qweight: torch.Tensor, weight_type: str) -> torch.Tensor:
    """The stored values `[K, N]` in sorted-K order: int32 codes 0..15 (4-bit types), int32 (int8), float32 (fp8)."""
    if weight_type in _FOUR_BIT:
        return _unpack_rows(qweight, 4)
    if weight_type == "int8":
        return qweight.to(torch.int32)
    return qweight.float()


def _dequant_kn(qweight, scales, zeros, weight_type, group) -> torch.Tensor:
    """`[K, N]` float32 weights in sorted-K order: s * (v - z), exact in fp32 for 16-bit scales; with mins
    s * v - m, rounded once."""
    v = unpack_values(qweight, weight_type)
    if weight_type == "int4":
        v = v - 8
    elif weight_type in _CODE_BOOKS:
        v = torch.tensor(_CODE_BOOKS[weight_type], dtype=torch.float32, device=v.device)[v]
    if has_mins(zeros):
        return v.float() * scales.float().repeat_interleave(group, 0) - zeros.repeat_interleave(group, 0)
    if zeros is not None:
        v = v - zeros.to(torch.int32).repeat_interleave(group, 0)
    return v.float() * scales.float().repeat_interleave(group, 0)


def dequantize_wna16(qweight, scales, zeros, perm, weight_type) -> torch.Tensor:
    """The weight `[N, K]` as float32 in the checkpoint's K order (act-order undone): for tests, debugging and a
    dense fallback."""
    K, N, group = _check_weight(qweight, scales, zeros, perm, weight_type)
    w = _dequant_kn(qweight, scales, zeros, weight_type, group)
    if perm is not None:
        w = torch.empty_like(w).index_copy_(0, perm.long(), w)
    return w.T.contiguous()


def wna16_gemm_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    weight_type: str,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference (the tests' oracle, and the CPU path of the types `kernels/cpu/wna16.c` does not take): the
    weight dequantized once to fp32, an fp32 matmul, the bias added in fp32, one rounding to `out_dtype`."""
    _, _, group = check_args(x, qweight, scales, zeros, perm, weight_type, out_dtype, bias)
    w = _dequant_kn(qweight, scales, zeros, weight_type, group)
    xs = x.float()
    if perm is not None:
        xs = xs.index_select(1, perm)
    out = xs @ w
    if bias is not None:
        out = out + bias.float().reshape(1, -1)
    return out.to(out_dtype)


# ------------------------------------------------------------------------------------------- kernel


@triton.jit
def _weight_tile(w_ptr, kt, w_cols, stride_wk, z, WTYPE: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The `[BLOCK_K, BLOCK_N]` fp32 tile of K step kt: values minus zero points (fp4: twice the value, an
    integer; the launcher halves its scales). Every value is exact in bf16 and fp16."""
    if WTYPE <= _FP4_BNB:
        rows = kt * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wk + w_cols[None, :])
        shifts = tl.arange(0, 8) * 4
        c = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        w = _decode4(c, z[None, :], WTYPE, HAS_ZEROS)
    else:
        rows = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wk + w_cols[None, :]
        if WTYPE == _INT8:
            v = tl.load(ptrs).to(tl.int32)
            if HAS_ZEROS:
                v = v - z[None, :]
            w = v.to(tl.float32)
        else:
            # fp8 arrives as its bytes (the interpreter cannot load fp8 directly).
            w = tl.load(ptrs).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return w


@triton.jit
def _decode4(c, zz, WTYPE: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """4-bit codes -> fp32 values minus zero points `zz` (broadcast against c; fp4: the launcher's scale
    multiplier undoes the integer stand-ins)."""
    if WTYPE == _NF4:
        w = _nf4_value(c)
    elif WTYPE == _FP4:
        e = (c >> 1) & 3
        m = c & 1
        mag = tl.where(e == 0, m, ((2 + m) << e) >> 1)  # 2 * |value|: 0, 1, 2, 3, 4, 6, 8, 12
        w = tl.where(c >= 8, -mag, mag).to(tl.float32)
    elif WTYPE == _FP4_BNB:
        e = (c >> 1) & 3
        m = c & 1
        mag = tl.where(e == 0, m, (2 + m) << (7 - e))  # 192 * |value|: 0, 1, 128, 192, 64, 96, 32, 48
        w = tl.where(c >= 8, -mag, mag).to(tl.float32)
    else:
        # 2^23 + c as fp32 bits, minus 2^23 and the zero point: exact, and no int-to-float conversion (a
        # reduced-rate instruction that bounds a decode-sized GEMM).
        w = (c | 0x4B000000).to(tl.float32, bitcast=True)
        if HAS_ZEROS:
            w = w - (zz.to(tl.float32) + 8388608.0)
        else:
            w = w - 8388616.0
    return w


@triton.jit
def _nibble_dot(x_rows, k8, s: tl.constexpr, w, acc, X_DTYPE: tl.constexpr, DOT_F32: tl.constexpr,
                SWAP: tl.constexpr):
    """`acc` plus nibble s's weights `w` times x's columns 8j + s (SWAP: transposed, see `_nibble_dots`)."""
    x = tl.load(x_rows + (k8 + s)[None, :])
    if SWAP:
        acc = _dot_t(w, x, acc, X_DTYPE, DOT_F32)
    else:
        acc = _dot(x, w, acc, X_DTYPE, DOT_F32)
    return acc


@triton.jit
def _dot_t(w, x, acc, X_DTYPE: tl.constexpr, DOT_F32: tl.constexpr):
    """`acc` (`[BLOCK_N, BLOCK_M]`) plus w `[BLOCK_N, k]` times x `[BLOCK_M, k]` transposed."""
    if DOT_F32:
        acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(w.to(X_DTYPE), tl.trans(x), acc)
    return acc


@triton.jit
def _weight_tile_t(w_ptr, kt, w_cols, stride_wk, z, WTYPE: tl.constexpr, HAS_ZEROS: tl.constexpr,
                   X_DTYPE: tl.constexpr, ASM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The transposed tile `[BLOCK_N, BLOCK_K]` of K step kt in natural K order (swap_ab without nibble dots).
    ASM: the eight `nibbles.nibbles16` outputs put in K order (`nibbles.in_k_order`); else `_weight_tile`
    transposed (fp32)."""
    if ASM:
        rows = kt * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + rows.to(tl.int64)[None, :] * stride_wk + w_cols[:, None])
        w0, w1, w2, w3, w4, w5, w6, w7 = nibbles16(words, z[:, None], HAS_ZEROS, X_DTYPE)
        w = in_k_order(w0, w1, w2, w3, w4, w5, w6, w7)
    else:
        w = tl.trans(_weight_tile(w_ptr, kt, w_cols, stride_wk, z, WTYPE, HAS_ZEROS, BLOCK_K, BLOCK_N))
    return w


@triton.jit
def _nibble_dots(x_rows, w_ptr, kt, w_cols, stride_wk, z, acc, WTYPE: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 X_DTYPE: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
                 SWAP: tl.constexpr):
    """`acc` plus the product of K step kt for the 4-bit types: nibble s of word row j holds k = 8j + s, so the
    step is eight dots of K = BLOCK_K / 8, each against x's columns 8j + s.

    SWAP: the weights are the dots' first operand (`[BLOCK_N, BLOCK_K / 8]` against x's columns transposed) and
    `acc` is the transposed tile `[BLOCK_N, BLOCK_M]`: for a few rows the weights fill the tensor cores' 64-row
    side and stay in registers, x (the small operand) goes through shared memory. ASM (int4 / uint4 with 16-bit
    activations, compiled): the nibbles become 16-bit operands through `nibbles.nibbles16`, no fp32 step."""
    rows = kt * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    k8 = kt * BLOCK_K + tl.arange(0, BLOCK_K // 8) * 8
    if SWAP:
        words = tl.load(w_ptr + rows.to(tl.int64)[None, :] * stride_wk + w_cols[:, None])
        zz = z[:, None]
    else:
        words = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wk + w_cols[None, :])
        zz = z[None, :]
    if ASM:
        w0, w1, w2, w3, w4, w5, w6, w7 = nibbles16(words, zz, HAS_ZEROS, X_DTYPE)
        acc = _nibble_dot(x_rows, k8, 0, w0, acc, X_DTYPE, DOT_F32, SWAP)
        acc = _nibble_dot(x_rows, k8, 1, w1, acc, X_DTYPE, DOT_F32, SWAP)
        acc = _nibble_dot(x_rows, k8, 2, w2, acc, X_DTYPE, DOT_F32, SWAP)
        acc = _nibble_dot(x_rows, k8, 3, w3, acc, X_DTYPE, DOT_F32, SWAP)
        acc = _nibble_dot(x_rows, k8, 4, w4, acc, X_DTYPE, DOT_F32, SWAP)
        acc = _nibble_dot(x_rows, k8, 5, w5, acc, X_DTYPE, DOT_F32, SWAP)
        acc = _nibble_dot(x_rows, k8, 6, w6, acc, X_DTYPE, DOT_F32, SWAP)
        acc = _nibble_dot(x_rows, k8, 7, w7, acc, X_DTYPE, DOT_F32, SWAP)
    else:
        for s in tl.static_range(8):
            w = _decode4((words >> (4 * s)) & 0xF, zz, WTYPE, HAS_ZEROS)
            acc = _nibble_dot(x_rows, k8, s, w, acc, X_DTYPE, DOT_F32, SWAP)
    return acc


@triton.jit
def _word_rows(w_ptr, kt, w_cols, stride_wk, BLOCK_K: tl.constexpr):
    """The `[BLOCK_K / 8, BLOCK_N]` packed words of K step kt."""
    rows = kt * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wk + w_cols[None, :])


@triton.jit
def _group_zeros(z_ptr, g, stride_zg, w_cols, HAS_ZEROS: tl.constexpr):
    """Group g's zero points of the tile's columns as int32 (without zeros, `w_cols` as a placeholder)."""
    if HAS_ZEROS:
        z = tl.load(z_ptr + g * stride_zg + w_cols).to(tl.int32)
    else:
        z = w_cols
    return z


@triton.jit
def _group_scales(s_ptr, g, stride_sg, w_cols):
    """Group g's scales of the tile's columns in fp32."""
    return tl.load(s_ptr + g * stride_sg + w_cols).to(tl.float32)


@triton.jit
def _group_mins(z_ptr, g, stride_zg, w_cols):
    """Group g's float offsets (mins) of the tile's columns (`zeros` holding float32 offsets)."""
    return tl.load(z_ptr + g * stride_zg + w_cols)


@triton.jit
def _gemv_step4(acc2, words, x_row, s_ptr, z_ptr, w_cols, kt, steps_per_group, stride_sg, stride_zg,
                WTYPE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, ONE_GROUP: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """`acc2` plus K step kt of one activation row against its packed `words` (4-bit types, FMA path). With mins,
    each word row's activations (summed) times the group's offsets are subtracted beside its scaled products."""
    g = kt // steps_per_group
    z = _group_zeros(z_ptr, g, stride_zg, w_cols, HAS_ZEROS)
    k8 = kt * BLOCK_K + tl.arange(0, BLOCK_K // 8) * 8
    step = tl.zeros(acc2.shape, dtype=tl.float32)
    x_words = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)
    for sh in tl.static_range(8):
        xs = tl.load(x_row + k8 + sh).to(tl.float32)
        step += xs[:, None] * _decode4((words >> (4 * sh)) & 0xF, z[None, :], WTYPE, HAS_ZEROS)
        if HAS_MINS:
            x_words += xs
    if ONE_GROUP:
        acc2 += step
    else:
        acc2 += step * _group_scales(s_ptr, g, stride_sg, w_cols)[None, :]
    if HAS_MINS:
        acc2 -= x_words[:, None] * _group_mins(z_ptr, g, stride_zg, w_cols)[None, :]
    return acc2


@triton.jit
def _gemv_range(x_row, w_ptr, s_ptr, z_ptr, w_cols, kt_begin, kt_end, steps_per_group, scale_mult, stride_wk,
                stride_sg, stride_zg, WTYPE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr,
                ONE_GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, PIPE: tl.constexpr,
                STAGES: tl.constexpr):
    """One activation row times K steps [kt_begin, kt_end) of a column tile, on the FMA units (BLOCK_M = 1): each
    step's exact products join a `[BLOCK_K (/ 8), BLOCK_N]` fp32 accumulator elementwise, so nothing crosses
    threads until one sum over K after the loop, and no tile is laid out again for a tensor-core dot. The
    `[1, BLOCK_N]` result has its scales applied.

    PIPE (4-bit types; the loop has no dot, which is what Triton's pipeliner looks for): 0 a plain loop; 1 the
    next step's words are loaded into registers before this step's arithmetic (one tile in flight behind the
    one being used); 2 the loop is `tl.range(num_stages=STAGES)`, asking Triton to pipeline its loads through
    shared memory."""
    if WTYPE <= _FP4_BNB:
        acc2 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        if PIPE == 2:
            for kt in tl.range(kt_begin, kt_end, num_stages=STAGES):
                words = _word_rows(w_ptr, kt, w_cols, stride_wk, BLOCK_K)
                acc2 = _gemv_step4(acc2, words, x_row, s_ptr, z_ptr, w_cols, kt, steps_per_group, stride_sg,
                                   stride_zg, WTYPE, HAS_ZEROS, HAS_MINS, ONE_GROUP, BLOCK_K)
        elif PIPE == 1:
            words = _word_rows(w_ptr, kt_begin, w_cols, stride_wk, BLOCK_K)
            for kt in range(kt_begin, kt_end):
                ahead = _word_rows(w_ptr, tl.minimum(kt + 1, kt_end - 1), w_cols, stride_wk, BLOCK_K)
                acc2 = _gemv_step4(acc2, words, x_row, s_ptr, z_ptr, w_cols, kt, steps_per_group, stride_sg,
                                   stride_zg, WTYPE, HAS_ZEROS, HAS_MINS, ONE_GROUP, BLOCK_K)
                words = ahead
        else:
            for kt in range(kt_begin, kt_end):
                words = _word_rows(w_ptr, kt, w_cols, stride_wk, BLOCK_K)
                acc2 = _gemv_step4(acc2, words, x_row, s_ptr, z_ptr, w_cols, kt, steps_per_group, stride_sg,
                                   stride_zg, WTYPE, HAS_ZEROS, HAS_MINS, ONE_GROUP, BLOCK_K)
    else:
        acc2 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for kt in range(kt_begin, kt_end):
            g = kt // steps_per_group
            z = _group_zeros(z_ptr, g, stride_zg, w_cols, HAS_ZEROS)
            w = _weight_tile(w_ptr, kt, w_cols, stride_wk, z, WTYPE, HAS_ZEROS, BLOCK_K, BLOCK_N)
            xs = tl.load(x_row + kt * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.float32)
            if ONE_GROUP:
                acc2 += xs[:, None] * w
            else:
                acc2 += (xs[:, None] * w) * _group_scales(s_ptr, g, stride_sg, w_cols)[None, :]
            if HAS_MINS:
                acc2 -= xs[:, None] * _group_mins(z_ptr, g, stride_zg, w_cols)[None, :]
    acc = tl.sum(acc2, axis=0)
    if ONE_GROUP:
        acc = acc * _group_scales(s_ptr, 0, stride_sg, w_cols)
    return (acc * scale_mult)[None, :]


@triton.jit
def _nf4_value(c):
    """NF4_VALUES[c] as fp32, by a select tree on the code's bits (a 16-entry table in registers)."""
    b0 = (c & 1) != 0
    b1 = (c & 2) != 0
    b2 = (c & 4) != 0
    lo = tl.where(b2,
                  tl.where(b1, tl.where(b0, 0.0, -0.09105003625154495), tl.where(b0, -0.18477343022823334,
                                                                                 -0.28444138169288635)),
                  tl.where(b1, tl.where(b0, -0.39491748809814453, -0.5250730514526367),
                           tl.where(b0, -0.6961928009986877, -1.0)))
    hi = tl.where(b2,
                  tl.where(b1, tl.where(b0, 1.0, 0.7229568362236023), tl.where(b0, 0.5626170039176941,
                                                                               0.44070982933044434)),
                  tl.where(b1, tl.where(b0, 0.33791524171829224, 0.24611230194568634),
                           tl.where(b0, 0.16093020141124725, 0.07958029955625534)))
    return tl.where((c & 8) != 0, hi, lo).to(tl.float32)


@triton.jit
def _dot(x, w, acc, X_DTYPE: tl.constexpr, DOT_F32: tl.constexpr):
    if DOT_F32:
        # fp32 activations, and the interpreter (whose numpy has no bf16 matmul).
        acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
    else:
        acc = tl.dot(x, w.to(X_DTYPE), acc)
    return acc


@triton.jit
def _step_dot(x_rows, offs_k, w_ptr, kt, w_cols, stride_wk, z, acc, WTYPE: tl.constexpr, HAS_ZEROS: tl.constexpr,
              X_DTYPE: tl.constexpr, DOT_F32: tl.constexpr, NIBBLES: tl.constexpr, ASM: tl.constexpr,
              SWAP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """`acc` plus the unscaled product of K step kt (`[BLOCK_N, BLOCK_M]`, the transposed tile, with SWAP)."""
    if NIBBLES:
        acc = _nibble_dots(x_rows, w_ptr, kt, w_cols, stride_wk, z, acc, WTYPE, HAS_ZEROS, X_DTYPE, DOT_F32, BLOCK_K,
                           ASM, SWAP)
    else:
        x = tl.load(x_rows + (kt * BLOCK_K + offs_k)[None, :])
        if SWAP:
            w = _weight_tile_t(w_ptr, kt, w_cols, stride_wk, z, WTYPE, HAS_ZEROS, X_DTYPE, ASM, BLOCK_K, BLOCK_N)
            acc = _dot_t(w, x, acc, X_DTYPE, DOT_F32)
        else:
            w = _weight_tile(w_ptr, kt, w_cols, stride_wk, z, WTYPE, HAS_ZEROS, BLOCK_K, BLOCK_N)
            acc = _dot(x, w, acc, X_DTYPE, DOT_F32)
    return acc


@triton.jit
def _group_scaled_step(acc, x_rows, offs_k, w_ptr, s_ptr, z_ptr, kt, w_cols, steps_per_group, scale_mult, stride_wk,
                       stride_sg, stride_zg, WTYPE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr,
                       X_DTYPE: tl.constexpr, DOT_F32: tl.constexpr, NIBBLES: tl.constexpr, ASM: tl.constexpr,
                       SWAP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """`acc` plus K step kt's product from exact operands times its group's scales in fp32 (each K step lies in
    one group; `acc` is the transposed tile with SWAP), less the group's mins times the step's activation sums."""
    g = kt // steps_per_group
    z = _group_zeros(z_ptr, g, stride_zg, w_cols, HAS_ZEROS)
    part = _step_dot(x_rows, offs_k, w_ptr, kt, w_cols, stride_wk, z, tl.zeros(acc.shape, dtype=tl.float32), WTYPE,
                     HAS_ZEROS, X_DTYPE, DOT_F32, NIBBLES, ASM, SWAP, BLOCK_K, BLOCK_N)
    s = _group_scales(s_ptr, g, stride_sg, w_cols) * scale_mult
    if SWAP:
        acc += part * s[:, None]
    else:
        acc += part * s[None, :]
    if HAS_MINS:
        x_sums = tl.sum(tl.load(x_rows + (kt * BLOCK_K + offs_k)[None, :]).to(tl.float32), axis=1)
        mins = _group_mins(z_ptr, g, stride_zg, w_cols)
        if SWAP:
            acc -= mins[:, None] * x_sums[None, :]
        else:
            acc -= x_sums[:, None] * mins[None, :]
    return acc


@triton.jit(do_not_specialize=["M", "k_tiles_per_split", "split_k"])
def _wna16_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, k_tiles, k_tiles_per_split, split_k, steps_per_group, scale_mult,
    stride_xm, stride_wk, stride_sg, stride_zg, stride_om,
    WTYPE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    ONE_GROUP: tl.constexpr, DOT_F32: tl.constexpr, FAST: tl.constexpr, NIBBLES: tl.constexpr,
    ASM: tl.constexpr, SWAP: tl.constexpr, PIPE: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    tile, split, rows, cols = common.gemm_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # Wrapped indices keep every main-loop load in bounds without masks; their results are never stored.
    x_rows = x_ptr + (rows % M).to(tl.int64)[:, None] * stride_xm
    w_cols = cols % N
    offs_k = tl.arange(0, BLOCK_K)
    kt_begin = split * k_tiles_per_split
    kt_end = tl.minimum(kt_begin + k_tiles_per_split, k_tiles)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BLOCK_M == 1:
        acc = _gemv_range(x_ptr + tl.min(rows, axis=0).to(tl.int64) * stride_xm, w_ptr, s_ptr, z_ptr, w_cols,
                          kt_begin, kt_end, steps_per_group, scale_mult, stride_wk, stride_sg, stride_zg, WTYPE,
                          HAS_ZEROS, HAS_MINS, ONE_GROUP, BLOCK_K, BLOCK_N, PIPE, STAGES)
    elif SWAP:
        # The weights as the dots' first operand (nibble dots, or one dot over the transposed tile): the
        # accumulator is the transposed tile until the end. Per channel (one group) g stays 0 and the one scale
        # row multiplies every step.
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kt in range(kt_begin, kt_end):
            acc_t = _group_scaled_step(acc_t, x_rows, offs_k, w_ptr, s_ptr, z_ptr, kt, w_cols, steps_per_group,
                                       scale_mult, stride_wk, stride_sg, stride_zg, WTYPE, HAS_ZEROS, HAS_MINS,
                                       x_ptr.dtype.element_ty, DOT_F32, NIBBLES, ASM, True, BLOCK_K, BLOCK_N)
        acc = tl.trans(acc_t)
    elif ONE_GROUP:
        # Per channel: one zero row, one scale row, applied after the loop.
        z = _group_zeros(z_ptr, 0, stride_zg, w_cols, HAS_ZEROS)
        for kt in range(kt_begin, kt_end):
            acc = _step_dot(x_rows, offs_k, w_ptr, kt, w_cols, stride_wk, z, acc, WTYPE, HAS_ZEROS,
                            x_ptr.dtype.element_ty, DOT_F32, NIBBLES, ASM, False, BLOCK_K, BLOCK_N)
        acc = acc * (_group_scales(s_ptr, 0, stride_sg, w_cols) * scale_mult)[None, :]
    else:
        # One flat loop (software-pipelined by Triton), each step's product scaled before it joins the accumulator.
        for kt in range(kt_begin, kt_end):
            acc = _group_scaled_step(acc, x_rows, offs_k, w_ptr, s_ptr, z_ptr, kt, w_cols, steps_per_group,
                                     scale_mult, stride_wk, stride_sg, stride_zg, WTYPE, HAS_ZEROS, HAS_MINS,
                                     x_ptr.dtype.element_ty, DOT_F32, NIBBLES, ASM, False, BLOCK_K, BLOCK_N)

    # Only the tile's real rows travel (at M = 1 one of block_m = 16); the padding rows are never stored.
    common.finish_tile(acc, out_ptr, bias_ptr, ws_ptr, lock_ptr, tile, split, split_k, rows, cols, M, N, stride_om,
                       SPLIT, HAS_BIAS, FAST, BLOCK_M, BLOCK_N)


# ------------------------------------------------------------------------------------------- launcher


def wna16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    weight_type: str,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    *,
    config: WNA16Config | None = None,
) -> torch.Tensor:
    """Triton `wna16_gemm_ref`; see the module docstring. `config` overrides the tuning table (tests, tuning).
    No host sync: capturable in a CUDA graph."""
    K, N, group = check_args(x, qweight, scales, zeros, perm, weight_type, out_dtype, bias)
    M = x.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if perm is not None:
        x = x.index_select(1, perm)
    elif x.stride(1) != 1:
        x = x.contiguous()
    # (In x's dtype only: an fp32 output of bf16 rows would pass through bf16 here.)
    dense_ok = (out_dtype == x.dtype and (bias is None or bias.dtype == x.dtype)
                and wna16_dequant.takes(weight_type))
    if (config is None and group < DENSE_BELOW_GROUP and DENSE_MIN_ROWS <= M and dense_ok
            and common.launch_feature("wna16_dense_prompts", x.device)):
        return _dense_product(x, qweight, scales, zeros, weight_type, group, bias, out)
    cfg = config or select_config(N, K, M, x.device, weight_type, zeros, group)
    if cfg.dense and dense_ok:
        return _dense_product(x, qweight, scales, zeros, weight_type, group, bias, out)
    if cfg.oneshot:
        if wna16_gemv.takes(weight_type, zeros, group):
            wna16_gemv.w4_gemv(x, qweight, scales, zeros, out, bias, block_n=cfg.block_n, block_k=cfg.block_k,
                               num_warps=cfg.num_warps)
            return out
        if config is None:
            # A table's one-shot tile on the FMA path instead spills (1.4 ms for 8-bit 6144 x 4096 at M = 1); a
            # config passed in runs its own tiles on the FMA path.
            cfg = default_config(M)
    block_k = fit_block_k(cfg.block_k, group)
    k_tiles = K // block_k
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    split_k = split_for(cfg.split_k, tiles, k_tiles, common.num_sms(x.device, off_cuda=4))
    if tiles > common.ARRIVAL_SLOTS:
        split_k = 1
    per_split = triton.cdiv(k_tiles, split_k)
    split_k = triton.cdiv(k_tiles, per_split)  # no empty splits
    ws = torch.empty(tiles * split_k * cfg.block_m * cfg.block_n if split_k > 1 else 1, dtype=torch.float32,
                     device=x.device)
    if cfg.prescale and wna16_tc.takes(weight_type, x.dtype, has_mins(zeros), group, K, cfg.block_k, cfg.block_m,
                                       cfg.swap_ab):
        wna16_tc.tc_gemm(x, qweight, scales, zeros, out, bias, ws, tiles=tiles, per_split=per_split, split_k=split_k,
                         block_m=cfg.block_m, block_n=cfg.block_n, block_k=block_k, group_m=cfg.group_m,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages, swap_ab=cfg.swap_ab,
                         nibble_dots=cfg.nibble_dots)
        return out
    w = qweight.view(torch.uint8) if weight_type == "fp8_e4m3" else qweight
    z = zeros if zeros is not None else scales
    mins = has_mins(zeros)
    bias_t = bias.reshape(-1).contiguous() if bias is not None else scales
    four_bit = weight_type in _FOUR_BIT
    nibbles = cfg.nibble_dots and four_bit and block_k >= 128 and cfg.block_m >= 16
    swap = cfg.swap_ab and cfg.block_m >= 16
    _wna16_kernel[(tiles, split_k)](
        x, w, scales, z, bias_t, out, ws, common.arrival_counters(x.device),
        M, N, k_tiles, per_split, split_k, group // block_k, _SCALE_MULT.get(weight_type, 1.0),
        x.stride(0), w.stride(0), scales.stride(0), z.stride(0), out.stride(0),
        WTYPE=_CODE[weight_type], HAS_ZEROS=zeros is not None and not mins, HAS_MINS=mins,
        HAS_BIAS=bias is not None, SPLIT=split_k > 1,
        # With mins every step takes its group's offsets, so one group is looped like many.
        ONE_GROUP=scales.shape[0] == 1 and not mins, DOT_F32=not x.is_cuda or x.dtype == torch.float32, FAST=x.is_cuda,
        NIBBLES=nibbles, ASM=cfg.fast_convert and (nibbles or swap) and _asm_ok(x, weight_type),
        SWAP=swap, PIPE=cfg.fma_pipeline if four_bit else 0,
        STAGES=cfg.num_stages, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _dense_product(x, qweight, scales, zeros, weight_type, group, bias, out) -> torch.Tensor:
    w = wna16_dequant.dequantize_kn(qweight, scales, zeros, weight_type, group, x.dtype)
    if bias is None:
        return torch.mm(x, w, out=out)
    return torch.addmm(bias.reshape(1, -1), x, w, out=out)


# Products of DENSE_MIN_ROWS rows or more over groups smaller than DENSE_BELOW_GROUP (GGUF's 16 and 32, whose tiles
# scale their accumulators every 16-32 K rows; the case measured) take the dense path (`wna16_dequant`: the weight
# written out, then cuBLAS) under the launch feature "wna16_dense_prompts"; larger groups keep the tiles.
DENSE_MIN_ROWS = 64
DENSE_BELOW_GROUP = 64


def _asm_ok(x: torch.Tensor, weight_type: str) -> bool:
    """Whether `fast_convert` applies: int4 / uint4 codes, 16-bit activations, a compiled (CUDA) launch; the
    interpreter cannot run inline PTX, and there the same configs take the portable conversion."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight_type in ("int4", "uint4")


def fit_block_k(block_k: int, group: int) -> int:
    """The largest power of two <= block_k dividing the group size (a K step never straddles two groups)."""
    bk = block_k
    while group % bk:
        bk //= 2
    return bk


def split_for(split_k: int, tiles: int, k_tiles: int, num_sms: int) -> int:
    """The configured split, or for 0 about two programs per SM while each split keeps >= 4 K steps, at most 16."""
    if split_k > 0:
        return max(1, min(split_k, k_tiles))
    if tiles >= num_sms:
        return 1
    return max(1, min((2 * num_sms) // tiles, k_tiles // 4, 16))


# ------------------------------------------------------------------------------------ tuning table


load_table = common.read_table


def lookup(entries: dict[str, dict], M: int) -> WNA16Config | None:
    """The entry of the smallest bucket holding M, else of the largest bucket."""
    entry = common.bucket_entry(entries, M)
    return None if entry is None else WNA16Config.from_json(entry)


# A GPU table's plain "N,K" entries serve the weights the one-shot GEMV runs (int4 / uint4, int8 in small groups
# without integer zero points): they were measured with int4 in groups of 128, and GGUF's int8 in groups of 16 end
# to end under them. Every other weight has entries of its own, "N,K,TYPE", or takes the default table: a plain
# entry's tiles (the one-shot GEMV at M = 1, the prescaled tiles) do not carry over to other codes and were
# measured at 260x their floor on 8-bit weights in groups of 128.
def table_key(N: int, K: int, weight_type: str, zeros: torch.Tensor | None = None, group: int = 128) -> str:
    return f"{N},{K}" if wna16_gemv.takes(weight_type, zeros, group) else f"{N},{K},{weight_type}"


def select_config(N: int, K: int, M: int, device: torch.device, weight_type: str = "int4",
                  zeros: torch.Tensor | None = None, group: int = 128) -> WNA16Config:
    """A tuned entry for (GPU, `table_key`) if one was measured, else the default table's entry for M."""
    cfg = lookup(common.gpu_table("wna16", device).get(table_key(N, K, weight_type, zeros, group), {}), M)
    if cfg is not None:
        return cfg
    return default_config(M)


def default_config(M: int) -> WNA16Config:
    cfg = lookup(load_table(DEFAULT_TABLE), M)
    return cfg if cfg is not None else WNA16Config(block_m=16, block_n=64, block_k=128, split_k=0)


# ------------------------------------------------------------------------------------ repacking
# Each checkpoint layout is unpacked to integer codes in torch, then `_from_kn` sorts act-order rows and packs the
# kernel's layout. All of it runs on the tensors' device, once, at load.


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 `[R, C]` packed along dim 0 (row pf*j + i at bits bits*i) -> unsigned codes int32 `[R * pf, C]`."""
    R, C = packed.shape
    v = (packed.unsqueeze(1) >> _shifts(bits, packed.device).view(1, -1, 1)) & ((1 << bits) - 1)
    return v.reshape(R * (32 // bits), C)


def _unpack_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 `[R, C]` packed along dim 1 (column pf*j + order[i] at bits bits*i; order defaults to i) ->
    unsigned codes int32 `[R, C * pf]`."""
    R, C = packed.shape
    v = (packed.unsqueeze(2) >> _shifts(bits, packed.device).view(1, 1, -1)) & ((1 << bits) - 1)
    if order is not None:
        slot_of = [order.index(c) for c in range(len(order))]  # the nibble holding column offset c
        v = v[:, :, slot_of]
    return v.reshape(R, C * (32 // bits))


def _pack_rows4(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 `[K, N]` -> int32 `[K // 8, N]`, row 8j + i at bits 4i."""
    K, N = codes.shape
    c = codes.to(torch.int64).reshape(K // 8, 8, N) << (4 * torch.arange(8, device=codes.device)).view(1, 8, 1)
    words = c.sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _act_order_perm(g_idx: torch.Tensor | None, K: int, G: int) -> torch.Tensor | None:
    """The row order that makes groups contiguous, or None when g_idx is absent or already k // group."""
    if g_idx is None or bool((g_idx < 0).all()):
        return None
    g_idx = g_idx.reshape(-1).long()
    group = K // G
    if g_idx.numel() != K:
        raise ValueError(f"wna16: g_idx must have K={K} entries, got {g_idx.numel()}")
    if bool(torch.equal(g_idx, torch.arange(K, device=g_idx.device) // group)):
        return None
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= G:
        raise ValueError(f"wna16: g_idx entries must lie in [0, {G})")
    counts = torch.bincount(g_idx, minlength=G)
    if bool((counts != group).any()):
        raise ValueError(f"wna16: act-order needs every group to hold group_size={group} rows of K")
    return torch.argsort(g_idx, stable=True).to(torch.int32)


def _scale_dtype(scales: torch.Tensor, scale_dtype: torch.dtype | None) -> torch.dtype:
    if scale_dtype is not None:
        return scale_dtype
    return scales.dtype if scales.dtype in _ACT_DTYPES else torch.float32


def _from_kn(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, g_idx: torch.Tensor | None,
             weight_type: str, scale_dtype: torch.dtype | None) -> WNA16Weight:
    """codes `[K, N]` in the checkpoint's K order (4-bit: unsigned codes; int8: signed values; fp8: e4m3),
    scales / zeros `[G, N]` -> the kernel's layout."""
    K, N = codes.shape
    if scales.dim() != 2 or scales.shape[1] != N or K % scales.shape[0]:
        raise ValueError(f"wna16: scales {tuple(scales.shape)} do not fit a weight of K={K}, N={N}")
    perm = _act_order_perm(g_idx, K, scales.shape[0])
    if perm is not None:
        codes = codes.index_select(0, perm.long())
    if weight_type in _FOUR_BIT:
        if K % 8:
            raise ValueError(f"wna16: 4-bit weights need K % 8 == 0, got K={K}")
        if int(codes.min()) < 0 or int(codes.max()) > 15:
            raise ValueError("wna16: 4-bit codes must lie in [0, 15]")
        qweight = _pack_rows4(codes)
    elif weight_type == "int8":
        if int(codes.min()) < -128 or int(codes.max()) > 127:
            raise ValueError("wna16: int8 values must lie in [-128, 127]")
        qweight = codes.to(torch.int8).contiguous()
    else:
        qweight = codes.to(torch.float8_e4m3fn).contiguous()
    if zeros is not None:
        zeros = zeros.to(torch.float32 if zeros.is_floating_point() else torch.int8).contiguous()
    out = WNA16Weight(qweight, scales.to(_scale_dtype(scales, scale_dtype)).contiguous(), zeros, perm, weight_type)
    _check_weight(*out)
    return out


def pack_wna16(
    values: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    *,
    weight_type: str,
    scale_dtype: torch.dtype | None = None,
) -> WNA16Weight:
    """Quantized values in the `[N, K]` convention -> the kernel's layout.

    values: int4: integers in [-8, 7]; uint4: [0, 15] with zeros [0, 15]; fp4_e2m1: codes 0..15 (integer dtype)
    or e2m1-representable floats; nf4, fp4_bnb: codes 0..15 (integer dtype); int8: int8 (zeros optional, signed);
    fp8_e4m3: float8_e4m3fn.
    scales `[N, K // group]` (or `[N]` / `[N, 1]`: per channel), zeros like scales (a floating dtype: offsets,
    w = s * v - m, for int4 and int8), g_idx `[K]` (act-order).
    W8A16 checkpoints (compressed-tensors naive int8 or FP8 with `weight_scale [N, 1]`) load through this."""
    if weight_type not in _CODE:
        raise ValueError(f"wna16: weight_type must be one of {WEIGHT_TYPES}, got {weight_type!r}")
    N = values.shape[0]
    if weight_type == "int4":
        codes = values.to(torch.int32) + 8
    elif weight_type == "fp4_e2m1" and values.is_floating_point():
        codes = _encode_e2m1(values)
    elif weight_type == "fp8_e4m3":
        if values.dtype != torch.float8_e4m3fn:
            raise ValueError(f"wna16: fp8_e4m3 values must be float8_e4m3fn, got {values.dtype}")
        codes = values
    else:
        codes = values.to(torch.int32)
    zeros_t = None
    if zeros is not None:
        zeros_t = zeros.reshape(N, -1).T.to(torch.float32 if zeros.is_floating_point() else torch.int32)
    return _from_kn(codes.T, scales.reshape(N, -1).T, zeros_t, g_idx, weight_type, scale_dtype)


def _encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    book = torch.tensor(FP4_E2M1_VALUES[:8], device=values.device)
    mag = values.float().abs()
    idx = torch.searchsorted(book, mag).clamp(max=7)
    if not bool((book[idx] == mag).all()):
        raise ValueError("wna16: fp4_e2m1 values must be exactly representable in e2m1")
    return idx.to(torch.int32) | (torch.signbit(values).to(torch.int32) << 3)


def repack_gptq(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    *,
    bits: int = 4,
    sym: bool = True,
    zeros_minus_one: bool = True,
    scale_dtype: torch.dtype | None = None,
) -> WNA16Weight:
    """GPTQ (AutoGPTQ / GPTQModel / HF optimum) -> the kernel's layout.

    qweight int32 `[K * bits / 32, N]` packed along K (value i of a word at bits bits*i), unsigned codes;
    qzeros int32 `[G, N * bits / 32]` packed along N; scales `[G, N]`; g_idx `[K]` (desc_act). sym: the zero is
    2^(bits-1) and qzeros is ignored (4-bit -> int4, 8-bit -> int8 = code - 128); else 4-bit -> uint4 with zeros,
    8-bit -> int8 with (code - 128, zero - 128). zeros_minus_one: qzeros holds zero - 1 (checkpoint_format "gptq",
    the v1 format most checkpoints use); False for "gptq_v2"."""
    if bits not in (4, 8):
        raise ValueError(f"wna16: GPTQ bits must be 4 or 8, got {bits}")
    codes = _unpack_rows(qweight, bits)
    zeros = None
    if not sym:
        if qzeros is None:
            raise ValueError("wna16: asymmetric GPTQ needs qzeros")
        zeros = _unpack_cols(qzeros, bits)[:, : codes.shape[1]]
        if zeros_minus_one:
            zeros = (zeros + 1) & ((1 << bits) - 1)
    if bits == 4:
        return _from_kn(codes, scales, zeros, g_idx, "int4" if sym else "uint4", scale_dtype)
    return _from_kn(codes - 128, scales, None if zeros is None else zeros - 128, g_idx, "int8", scale_dtype)


def repack_awq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    *,
    scale_dtype: torch.dtype | None = None,
) -> WNA16Weight:
    """AWQ GEMM (AutoAWQ) -> uint4 with zeros. qweight int32 `[K, N // 8]` and qzeros int32 `[G, N // 8]` packed
    along N in AWQ's interleaved order (nibble i holds column 8j + AWQ_ORDER[i]); scales `[G, N]`."""
    codes = _unpack_cols(qweight, 4, AWQ_ORDER)
    zeros = _unpack_cols(qzeros, 4, AWQ_ORDER)
    return _from_kn(codes, scales, zeros, None, "uint4", scale_dtype)


def repack_compressed_tensors(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
    *,
    num_bits: int = 4,
    weight_shape: tuple[int, int] | torch.Tensor | None = None,
    scale_dtype: torch.dtype | None = None,
) -> WNA16Weight:
    """compressed-tensors "pack-quantized" (INT weights, llm-compressor's W4A16 / W8A16) -> the kernel's layout.

    weight_packed int32 `[N, K * num_bits / 32]` packed along K (value i at bits num_bits*i), each value stored
    as signed + 2^(num_bits-1); weight_scale `[N, G]`; weight_zero_point (asymmetric) either packed int32
    `[ceil(N * num_bits / 32), G]` along N with the same offset (as the compressor writes it), or unpacked
    signed integers `[N, G]`; weight_g_idx `[K]` (actorder "group"). weight_shape `(N, K)` checks the size."""
    if num_bits not in (4, 8):
        raise ValueError(f"wna16: compressed-tensors num_bits must be 4 or 8, got {num_bits}")
    N = weight_packed.shape[0]
    codes = _unpack_cols(weight_packed, num_bits)
    if weight_shape is not None:
        N_s, K_s = (int(v) for v in weight_shape)
        if N_s != N or K_s != codes.shape[1]:
            raise ValueError(f"wna16: weight_shape {(N_s, K_s)} needs K a multiple of {32 // num_bits}, and N={N}")
    offset = 1 << (num_bits - 1)
    zeros = None
    if weight_zero_point is not None:
        zp = weight_zero_point
        G = weight_scale.reshape(N, -1).shape[1]
        if zp.dtype == torch.int32 and zp.shape[0] == -(-N * num_bits // 32) and zp.numel() != N * G:
            zeros = _unpack_rows(zp, num_bits)[:N]
        else:
            zeros = zp.reshape(N, -1).to(torch.int32) + offset
        zeros = zeros.T
    if num_bits == 4:
        return _from_kn(codes.T, weight_scale.reshape(N, -1).T, zeros, weight_g_idx,
                        "int4" if zeros is None else "uint4", scale_dtype)
    return _from_kn(codes.T - offset, weight_scale.reshape(N, -1).T, None if zeros is None else zeros - offset,
                    weight_g_idx, "int8", scale_dtype)


def repack_fp4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_g_idx: torch.Tensor | None = None,
    *,
    scale_dtype: torch.dtype | None = None,
) -> WNA16Weight:
    """FP4-E2M1 weights packed two per byte (uint8 `[N, K // 2]`, element 2j in the low nibble: NVFP4 and OCP MX)
    with scales `[N, K // group]` (NVFP4's global scale and MX's e8m0 exponents folded in by the loader)."""
    if weight_packed.dtype != torch.uint8 or weight_packed.dim() != 2:
        raise ValueError(f"wna16: fp4 weights must be a 2-D uint8 tensor, got {weight_packed.dtype}")
    N = weight_packed.shape[0]
    b = weight_packed.to(torch.int32)
    codes = torch.stack((b & 0xF, b >> 4), dim=2).reshape(N, -1)
    return _from_kn(codes.T, weight_scale.reshape(N, -1).T, None, weight_g_idx, "fp4_e2m1", scale_dtype)
