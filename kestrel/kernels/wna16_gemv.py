"""Decode GEMV for 4-bit integer weights (int4 / uint4, the `wna16` layout): one launch, each weight word read once.

The `wna16` FMA path (`block_m = 1`) walks K in a loop per program and spends about two integer instructions per
4-bit value taking the code out of its word (a shift, then a mask and the magic number's exponent), so at M = 1 it
runs near 1.5 TB/s, bound by the integer units, not the bytes. Here:

- Each program owns one `[BLOCK_K / 8 words, BLOCK_N columns]` slice of the packed weight and loads it whole in one
  wide load (every byte in flight at once, many programs per SM), as `kernels/gemv.py` does for 16-bit and FP8
  weights; partial sums over K slices meet as in that kernel (an fp32 workspace, summed in split order by the last
  program to arrive, counters left zeroed: deterministic and graph-safe).
- A code becomes fp32 in one integer instruction: nibble s of a word sits at bits 4s..4s+3; masked in place and
  or-ed with the exponent of 2^(23-4s) it is the float 2^(23-4s) + c exactly (the mantissa's unit in the last place
  at that exponent is 1), and one subtraction of 2^(23-4s) + z gives c - z. Nibbles 4-7 are read the same way
  from the word shifted right by 16: one shift per eight values. So about 1.1 integer and 2 float instructions
  per value at one row (mask-or, subtract, fma); each further row adds its fma (the compiler may share the
  decoded values across rows or decode again).
- The products (c - z) * x are summed in fp32 per group, then multiplied by the group's scale: `wna16_gemm_ref`'s
  numbers up to the order of the sums (the products are exact for 16-bit x; fp32 x rounds them as the reference
  does). With float offsets (int4 with mins: w = s * (c - 8) - m) each group's activations are summed beside and
  m times that sum subtracted.

Which layers take it: a `WNA16Config` with `block_m = 1` and `oneshot` set (the per-GPU table chooses it per M
bucket); int4 and uint4, and int8 in groups of 16 or 32 without integer zero points (`takes`; the other types keep
the FMA path). It reads the config's `block_n`, `block_k` and
`num_warps` (powers of two; the split is K / block_k); the other fields belong to the looped paths. Up to
`MAX_ROWS` rows per launch; more run in chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels import common

MAX_ROWS = 8
WEIGHT_TYPES = ("int4", "uint4")


def fit_block_k(block_k: int, group: int, K: int) -> int:
    """The largest power of two <= block_k (itself a power of two >= 8) that divides K and either divides the group
    size or is a multiple of it (a slice holds whole groups or lies inside one), at least one word (8 rows);
    ValueError where none does."""
    if block_k < 8 or block_k & (block_k - 1):
        raise ValueError(f"w4_gemv: block_k must be a power of two >= 8, got {block_k}")

    def fits(bk: int) -> bool:
        return K % bk == 0 and (group % bk == 0 if bk <= group else bk % group == 0)

    bk = block_k
    while bk > 8 and not fits(bk):
        bk //= 2
    if not fits(bk):
        raise ValueError(f"w4_gemv: no slice of whole words fits K = {K} with group {group}")
    return bk


@triton.jit(do_not_specialize=["stride_xm", "stride_om"])
def _w4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, ws_ptr, lock_ptr, N, group,
                    stride_xm, stride_wk, stride_sg, stride_zg, stride_om,
                    SPLIT_K: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, FAST: tl.constexpr,
                    EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, n] = sum_g s[g, n] * sum_{k in g} x[m, k] * (c[k, n] - z[g, n]) + bias[n] for the ROWS rows of x
    (with mins, less sum_g mins[g, n] * sum_{k in g} x[m, k]);
    this program reads word rows [split * BLOCK_K / 8, +BLOCK_K / 8) of BLOCK_N columns. GROUPS: the groups one
    slice holds (1 when the slice lies inside one group). Under PDL the words, zeros and scales are loaded before
    waiting for the previous kernel; x, the workspace, the counters and the output after."""
    if USE_PDL:
        gdc_launch_dependents()
    KW: tl.constexpr = BLOCK_K // 8
    pid, nb, split, cols, n_ok = common.split_program(N, SPLIT_K, BLOCK_N)
    if EVEN_N:
        wc = cols
    else:
        # Wrapped columns keep every load in bounds without an N mask; their results are not stored. (Only when
        # N needs it: the wrap hides the columns' contiguity from the compiler, which then loads word by word.)
        wc = cols % N
    wrows = split * KW + tl.arange(0, KW)
    words = tl.load(w_ptr + wrows.to(tl.int64)[:, None] * stride_wk + wc[None, :])
    upper = words >> 16
    first_g = (split * BLOCK_K) // group
    if not HAS_ZEROS:
        zf = tl.full((1, BLOCK_N), 8.0, tl.float32)
    elif GROUPS == 1:
        # One zero row for the whole slice: broadcast, so its sums with the magic numbers are per column, not per word.
        zf = tl.load(z_ptr + first_g * stride_zg + wc).to(tl.float32)[None, :]
    else:
        g_of_word = (wrows * 8) // group
        zf = tl.load(z_ptr + g_of_word[:, None] * stride_zg + wc[None, :]).to(tl.float32)
    sc, mn = _slice_scales(s_ptr, z_ptr, first_g, wc, stride_sg, stride_zg, GROUPS, HAS_MINS, BLOCK_N)
    if USE_PDL:
        gdc_wait()
    part = ws_ptr + pid.to(tl.int64) * (ROWS * BLOCK_N) + tl.arange(0, BLOCK_N)
    # One row at a time, each in a 2-D tile laid out like the words (a third dimension for the rows would make
    # the compiler give each thread one column and many K rows: a load of x per value instead of per word row).
    # The decode is written per row; the compiler may share it across rows (as it did for sm_90) or redo it.
    for m in tl.static_range(ROWS):
        acc = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
        x_words = tl.zeros((KW,), dtype=tl.float32)
        x_row = x_ptr + m * stride_xm + wrows * 8
        for s in tl.static_range(8):
            if s < 4:
                w = _nibble_minus_zero(words, zf, 4 * s, FAST)
            else:
                w = _nibble_minus_zero(upper, zf, 4 * (s - 4), FAST)
            xv = tl.load(x_row + s).to(tl.float32)
            acc += w * xv[:, None]
            if HAS_MINS:
                x_words += xv
        _put(_group_dot(acc, x_words, sc, mn, GROUPS, HAS_MINS, BLOCK_N), m, part, out_ptr, b_ptr, cols, wc, n_ok,
             stride_om, SPLIT_K, HAS_BIAS, FAST)
    _split_tail(ws_ptr, lock_ptr, nb, out_ptr, b_ptr, cols, wc, n_ok, stride_om, SPLIT_K, ROWS, HAS_BIAS, FAST,
                BLOCK_N)


@triton.jit(do_not_specialize=["stride_xm", "stride_om"])
def _i8_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, ws_ptr, lock_ptr, N, group,
                    stride_xm, stride_wk, stride_sg, stride_zg, stride_om,
                    SPLIT_K: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr, HAS_MINS: tl.constexpr,
                    HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, FAST: tl.constexpr, EVEN_N: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr, BYTE_PERMUTE: tl.constexpr):
    """`_w4_gemv_kernel` for int8 values `[K, N]` (no integer zero points): this program reads rows
    [split * STEPS * BLOCK_K, +STEPS * BLOCK_K) of BLOCK_N columns, BLOCK_K rows a step (more than one step for
    one row of x only), each value turned to fp32 as it is multiplied. Under `int8_layout` each warp has 512
    columns, 16 bytes a thread, so that a thread holds its columns' rows of the step whole: the sums per group stay
    in its registers."""
    tl.static_assert(STEPS == 1 or ROWS == 1, "several steps a program for one row of x only")
    if USE_PDL:
        gdc_launch_dependents()
    pid, nb, split, cols, n_ok = common.split_program(N, SPLIT_K, BLOCK_N)
    wc = cols if EVEN_N else cols % N
    krows = split * (STEPS * BLOCK_K) + tl.arange(0, BLOCK_K)
    w_rows = w_ptr + krows.to(tl.int64)[:, None] * stride_wk + wc[None, :]
    values = _int8_to_f32(tl.load(w_rows), BYTE_PERMUTE)
    sc, mn = _slice_scales(s_ptr, z_ptr, (split * STEPS * BLOCK_K) // group, wc, stride_sg, stride_zg, GROUPS,
                           HAS_MINS, BLOCK_N)
    if USE_PDL:
        gdc_wait()
    part = ws_ptr + pid.to(tl.int64) * (ROWS * BLOCK_N) + tl.arange(0, BLOCK_N)
    if STEPS == 1:
        for m in tl.static_range(ROWS):
            xv = tl.load(x_ptr + m * stride_xm + krows).to(tl.float32)
            _put(_group_dot(values * xv[:, None], xv, sc, mn, GROUPS, HAS_MINS, BLOCK_N), m, part, out_ptr, b_ptr,
                 cols, wc, n_ok, stride_om, SPLIT_K, HAS_BIAS, FAST)
    else:
        xv = tl.load(x_ptr + krows).to(tl.float32)
        dot = _group_dot(values * xv[:, None], xv, sc, mn, GROUPS, HAS_MINS, BLOCK_N)
        for step in range(1, STEPS):
            values = _int8_to_f32(tl.load(w_rows + step * BLOCK_K * stride_wk), BYTE_PERMUTE)
            sc, mn = _slice_scales(s_ptr, z_ptr, (split * STEPS + step) * BLOCK_K // group, wc, stride_sg, stride_zg,
                                   GROUPS, HAS_MINS, BLOCK_N)
            xv = tl.load(x_ptr + krows + step * BLOCK_K).to(tl.float32)
            dot += _group_dot(values * xv[:, None], xv, sc, mn, GROUPS, HAS_MINS, BLOCK_N)
        _put(dot, 0, part, out_ptr, b_ptr, cols, wc, n_ok, stride_om, SPLIT_K, HAS_BIAS, FAST)
    _split_tail(ws_ptr, lock_ptr, nb, out_ptr, b_ptr, cols, wc, n_ok, stride_om, SPLIT_K, ROWS, HAS_BIAS, FAST,
                BLOCK_N)


@triton.jit
def _slice_scales(s_ptr, z_ptr, first_g, wc, stride_sg, stride_zg, GROUPS: tl.constexpr, HAS_MINS: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """The slice's scales and (with mins) offsets in fp32: `[BLOCK_N]` for one group, `[GROUPS, BLOCK_N]` else
    (without mins the scales stand in for the offsets)."""
    if GROUPS == 1:
        rows = first_g
        sc = tl.load(s_ptr + rows * stride_sg + wc).to(tl.float32)
    else:
        rows = (first_g + tl.arange(0, GROUPS))[:, None]
        sc = tl.load(s_ptr + rows * stride_sg + wc[None, :]).to(tl.float32)
    mn = sc
    if HAS_MINS:
        if GROUPS == 1:
            mn = tl.load(z_ptr + rows * stride_zg + wc)
        else:
            mn = tl.load(z_ptr + rows * stride_zg + wc[None, :])
    return sc, mn


@triton.jit
def _group_dot(acc, x_parts, sc, mn, GROUPS: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_N: tl.constexpr):
    """A row's products `acc` ([rows of the slice, BLOCK_N], the slice's K in order) summed per group and scaled,
    less the offsets times the groups' sums of `x_parts` (the row's x summed per row of `acc`)."""
    if GROUPS == 1:
        dot = tl.sum(acc, axis=0) * sc
        if HAS_MINS:
            dot -= tl.sum(x_parts, axis=0) * mn
    else:
        per_group: tl.constexpr = acc.shape[0] // GROUPS
        dot = tl.sum(tl.sum(tl.reshape(acc, (GROUPS, per_group, BLOCK_N)), axis=1) * sc, axis=0)
        if HAS_MINS:
            x_groups = tl.sum(tl.reshape(x_parts, (GROUPS, per_group)), axis=1)
            dot -= tl.sum(x_groups[:, None] * mn, axis=0)
    return dot


@triton.jit
def _put(dot, m, part, out_ptr, b_ptr, cols, wc, n_ok, stride_om, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
         FAST: tl.constexpr):
    """Row m's finished sums: stored, or put in the workspace `part` when K is split."""
    if SPLIT_K == 1:
        _store(dot, m, out_ptr, b_ptr, cols, wc, n_ok, stride_om, HAS_BIAS, FAST)
    else:
        tl.store(part + m * dot.shape[0], dot)


@triton.jit
def _split_tail(ws_ptr, lock_ptr, nb, out_ptr, b_ptr, cols, wc, n_ok, stride_om, SPLIT_K: tl.constexpr,
                ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr, BLOCK_N: tl.constexpr):
    """With K split, the last program to arrive at the column block sums the rows' partials in split order."""
    if SPLIT_K > 1:
        is_last = common.last_arrival(lock_ptr + nb, SPLIT_K)
        if is_last:
            for m in tl.static_range(ROWS):
                _store(common.split_row_sum(ws_ptr, nb, m, SPLIT_K, ROWS, BLOCK_N), m, out_ptr, b_ptr, cols, wc,
                       n_ok, stride_om, HAS_BIAS, FAST)
            tl.atomic_xchg(lock_ptr + nb, 0)


def _lop3(sh: int) -> str:
    """PTX of one lop3 computing (word & (15 << sh)) | exponent bits of 2^(23 - sh) (lut 0xEA: (a & b) | c)."""
    return f"lop3.b32 $0, $1, {15 << sh}, {(150 - sh) << 23}, 0xEA;"


_LOP3_0 = tl.constexpr(_lop3(0))
_LOP3_4 = tl.constexpr(_lop3(4))
_LOP3_8 = tl.constexpr(_lop3(8))
_LOP3_12 = tl.constexpr(_lop3(12))


@triton.jit
def _nibble_minus_zero(src, zf, SH: tl.constexpr, ASM: tl.constexpr):
    """c - z in fp32 for the nibble at bits SH..SH+3 of `src`: masked in place into the mantissa of 2^(23 - SH), the
    float 2^(23 - SH) + c exactly, minus 2^(23 - SH) + z. ASM: the mask and the exponent in one lop3 (the compiler
    spends two instructions on the same expression)."""
    if ASM:
        if SH == 0:
            asm: tl.constexpr = _LOP3_0
        elif SH == 4:
            asm: tl.constexpr = _LOP3_4
        elif SH == 8:
            asm: tl.constexpr = _LOP3_8
        else:
            asm: tl.constexpr = _LOP3_12
        bits = tl.inline_asm_elementwise(asm, "=r,r", [src], dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (src & (15 << SH)) | ((150 - SH) << 23)
    return bits.to(tl.float32, bitcast=True) - (zf + (1 << (23 - SH)))


# Four int8 values of one register as fp32: the word's bytes flipped to v + 128 (one xor for four), then each byte
# placed under the exponent of 2^23 (one prmt), which is the float 2^23 + v + 128 exactly, less 2^23 + 128 (one
# add). The conversion instruction it replaces issues at an eighth of the adds' rate on sm_90.
_INT8X4_TO_F32 = tl.constexpr(
    "{ .reg .b32 t, e; xor.b32 t, $4, 0x80808080; mov.b32 e, 0x4B000000;"
    + "".join(f" prmt.b32 ${i}, t, e, {0x7540 + i}; sub.f32 ${i}, ${i}, 0f4B000080;" for i in range(4)) + " }")


@triton.jit
def _int8_to_f32(values, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise(_INT8X4_TO_F32, "=r,=r,=r,=r,r", [values], dtype=tl.float32, is_pure=True,
                                         pack=4)
    return values.to(tl.float32)


@triton.jit
def _store(y, m, out_ptr, b_ptr, cols, wc, n_ok, stride_om, HAS_BIAS: tl.constexpr, FAST: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(b_ptr + wc).to(tl.float32)
    tl.store(out_ptr + m * stride_om + cols, common.to_dtype(y, out_ptr.dtype.element_ty, FAST), mask=n_ok)


# int8 takes the one-shot GEMV in groups smaller than this (GGUF's 16 and 32), where the FMA path's K steps, which
# lie inside one group, are that short; larger groups and per-channel int8 (W8A16 checkpoints) keep the FMA path.
INT8_ONESHOT_GROUP = 64


# A 4-bit slice that spans several groups smaller than W4_GROUPED_BELOW (`w4_layout`, launch feature
# "wna16_grouped_layout"; GGUF's groups of 32, the case measured): a warp spans W4_WARP_COLUMNS columns (four words
# a thread) and the slice at most W4_GROUPED_ROWS rows, so each thread holds its columns' rows whole and the sums
# per group stay in its registers (in a narrower block the warps split the rows, and each group's sums crossed
# them through shared memory). Larger groups keep the tuned table's slices.
W4_WARP_COLUMNS = 128
W4_GROUPED_ROWS = 128
W4_GROUPED_BELOW = 64


def w4_layout(N: int, K: int, group: int, block_n: int, block_k: int, num_warps: int,
              grouped: bool) -> tuple[int, int]:
    """(block_n, block_k) of the 4-bit GEMV: the configured ones, unless `grouped` and the slice would span
    several small groups."""
    bk = fit_block_k(block_k, group, K)
    if grouped and group < W4_GROUPED_BELOW and bk > group:
        bk = fit_block_k(min(block_k, W4_GROUPED_ROWS), group, K)
        block_n = min(W4_WARP_COLUMNS * num_warps, max(block_n, triton.next_power_of_2(N)))
    return block_n, bk


# One row's int8 slices (`int8_layout`, launch feature "wna16_int8_wide"): a warp spans INT8_WARP_COLUMNS columns
# (16 bytes a thread) and the block up to INT8_MAX_WARPS warps; a step reads INT8_STEP_ROWS rows; a program takes up
# to INT8_MAX_STEPS steps while at least INT8_MIN_PROGRAMS programs are left (fewer splits: less of the fp32
# workspace to write and read). Compiled for sm_90 that is 168 registers and no spills; more rows of x (each thread
# then holds 256 fp32 values per row) spill, so they keep the configured layout, as int8 does with the feature off:
# the configured block_n and num_warps, half the configured block_k, each byte converted by the conversion unit.
INT8_WARP_COLUMNS = 512
INT8_MAX_WARPS = 2
INT8_STEP_ROWS = 16
INT8_MAX_STEPS = 8
INT8_MIN_PROGRAMS = 264


def int8_layout(N: int, K: int, group: int) -> tuple[int, int, int, int]:
    """(block_n, num_warps, block_k, steps) of the int8 GEMV of one row of x and a [K, N] weight in groups of
    `group` rows: as many columns a block as INT8_MAX_WARPS warps span (fewer for a narrow N)."""
    warps = max(1, min(INT8_MAX_WARPS, triton.next_power_of_2(N) // INT8_WARP_COLUMNS))
    block_n = min(warps * INT8_WARP_COLUMNS, triton.next_power_of_2(N))
    bk = fit_block_k(INT8_STEP_ROWS, group, K)
    steps = 1
    slices = K // bk
    n_blocks = triton.cdiv(N, block_n)
    while (steps * 2 <= INT8_MAX_STEPS and slices % (steps * 2) == 0
           and n_blocks * slices // (steps * 2) >= INT8_MIN_PROGRAMS):
        steps *= 2
    return block_n, warps, bk, steps


def has_mins(zeros: torch.Tensor | None) -> bool:
    """Whether `zeros` holds float offsets (w = s * v - m) rather than integer zero points."""
    return zeros is not None and zeros.is_floating_point()


def takes(weight_type: str, zeros: torch.Tensor | None, group: int) -> bool:
    """Whether the one-shot GEMV runs this weight: int4 / uint4, or int8 in small groups without integer zero
    points."""
    if weight_type == "int8":
        return group < INT8_ONESHOT_GROUP and (zeros is None or has_mins(zeros))
    return weight_type in WEIGHT_TYPES


def w4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            out: torch.Tensor, bias: torch.Tensor | None, *, block_n: int, block_k: int, num_warps: int) -> None:
    """Write `x @ dequant(qweight).T + bias` into `out` ([M, N]). `x` is [M, K] with its act-order permutation
    already applied (what `wna16.wna16_gemm` hands over after checking every argument); `qweight` int32
    [K / 8, N] of int4 (zeros None: the codes minus 8; or float32 mins [K / group, N]) or uint4 (zeros
    [K / group, N]) codes, or int8 [K, N] values (zeros None or float32 mins): `takes`. One row over int8 takes
    its own slices under "wna16_int8_wide" (`int8_layout`); otherwise int8 reads half the configured rows a slice,
    and 4-bit slices spanning several small groups are laid out by `w4_layout`."""
    M, K = x.shape
    N = qweight.shape[1]
    group = K // scales.shape[0]
    eight_bit = qweight.dtype == torch.int8
    if block_n < 1 or block_n & (block_n - 1):
        raise ValueError(f"w4_gemv: block_n must be a power of two, got {block_n}")
    wide = eight_bit and M == 1 and common.launch_feature("wna16_int8_wide", x.device)
    if wide:
        block_n, num_warps, bk, steps = int8_layout(N, K, group)
    elif eight_bit:
        bk, steps = fit_block_k(max(block_k // 2, 16), group, K), 1
    else:
        grouped = common.launch_feature("wna16_grouped_layout", x.device)
        block_n, bk, steps = *w4_layout(N, K, group, block_n, block_k, num_warps, grouped), 1
    split_k = K // (bk * steps)
    n_blocks = triton.cdiv(N, block_n)
    if split_k > 1 and n_blocks > common.ARRIVAL_SLOTS:
        raise ValueError(f"w4_gemv: {n_blocks} column blocks exceed the {common.ARRIVAL_SLOTS} arrival counters")
    x = x if x.stride(1) == 1 else x.contiguous()
    groups = bk // group if bk > group else 1
    z = zeros if zeros is not None else scales
    mins = has_mins(zeros)
    b = bias.reshape(-1).contiguous() if bias is not None else scales
    locks = common.arrival_counters(x.device) if split_k > 1 else scales
    for m0 in range(0, M, MAX_ROWS):
        xm, om = x[m0:m0 + MAX_ROWS], out[m0:m0 + MAX_ROWS]
        rows = xm.shape[0]
        ws = (torch.empty(n_blocks * split_k * rows * block_n, dtype=torch.float32, device=x.device)
              if split_k > 1 else scales)
        args = (xm, qweight, scales, z, b, om, ws, locks, N, group,
                xm.stride(0), qweight.stride(0), scales.stride(0), z.stride(0), om.stride(0))
        flags = dict(SPLIT_K=split_k, ROWS=rows, GROUPS=groups, HAS_MINS=mins, HAS_BIAS=bias is not None,
                     EVEN_N=N % block_n == 0, BLOCK_N=block_n, BLOCK_K=bk, num_warps=num_warps,
                     **common.launch_options(x, "pdl_decode"))
        if eight_bit:
            _i8_gemv_kernel[(n_blocks * split_k,)](*args, STEPS=steps, BYTE_PERMUTE=wide and x.is_cuda, **flags)
        else:
            _w4_gemv_kernel[(n_blocks * split_k,)](*args, HAS_ZEROS=zeros is not None and not mins, **flags)
