"""4-bit integer codes (int4 / uint4, eight to an int32 word) turned into 16-bit tensor-core operands by bit tricks
on whole words, for the weight-only kernels (`wna16`, `wna16_tc`): compiled only (inline PTX), exact; and the
eight nibble tensors put back in K order (`in_k_order`)."""

from __future__ import annotations

import triton
import triton.language as tl


def nibble_asm(kind: str) -> str:
    """PTX turning one int32 word ($8) into its eight nibbles minus a zero point, as 16-bit floats ($0..$7, nibble
    s in $s). Two nibbles at a time (bits 4i and 4i + 16) are masked into the mantissas of a pair of magic numbers
    whose unit in the last place is 1 (128 in bf16, 1024 in fp16) by one lop3, then one paired fma subtracts the
    magic plus the zero point ($9: that pair's bit pattern, so 128 + z in bf16): c - z, an integer of magnitude
    <= 15, exact. Four lop3, three shifts and four paired fmas per eight values, where the fp32 path spends about
    four instructions per value."""
    magic, one, op = {"bf16": ("0x43004300", "0x3f803f80", "fma.rn.bf16x2"),
                      "fp16": ("0x64006400", "0x3c003c00", "fma.rn.f16x2")}[kind]
    lines = ["{", ".reg .b32 t0, t1, t2, t3, s1, s2, s3, one, neg;", f"mov.b32 one, {one};",
             "or.b32 neg, $9, 0x80008000;", "shr.u32 s1, $8, 4;", "shr.u32 s2, $8, 8;", "shr.u32 s3, $8, 12;",
             f"lop3.b32 t0, $8, 0x000f000f, {magic}, 0xea;"]
    lines += [f"lop3.b32 t{i}, s{i}, 0x000f000f, {magic}, 0xea;" for i in (1, 2, 3)]
    lines += [f"{op} t{i}, t{i}, one, neg;" for i in range(4)]
    lines += [f"mov.b32 {{${i}, ${i + 4}}}, t{i};" for i in range(4)]
    return "\n".join(lines + ["}"])


_ASM_BF16 = tl.constexpr(nibble_asm("bf16"))
_ASM_FP16 = tl.constexpr(nibble_asm("fp16"))


@triton.jit
def _nibbles16_asm(words, zz, HAS_ZEROS: tl.constexpr, MAGIC: tl.constexpr, ASM: tl.constexpr):
    if HAS_ZEROS:
        zw = zz.to(tl.int32)
        pat = tl.zeros_like(words) + (MAGIC | zw | (zw << 16))
    else:
        pat = tl.zeros_like(words) + (MAGIC | 0x80008)
    return tl.inline_asm_elementwise(
        ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, pat],
        dtype=(tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16),
        is_pure=True, pack=1)


@triton.jit
def nibbles16(words, zz, HAS_ZEROS: tl.constexpr, X_DTYPE: tl.constexpr):
    """int4 / uint4 words -> eight X_DTYPE (bf16 / fp16) tensors of the words' shape, nibble s minus the zero
    point (8 for int4, `zz` broadcast against the words for uint4); compiled only (see `nibble_asm`)."""
    if X_DTYPE == tl.bfloat16:  # noqa: SIM300 (X_DTYPE is a constexpr argument, not a constant)
        w0, w1, w2, w3, w4, w5, w6, w7 = _nibbles16_asm(words, zz, HAS_ZEROS, 0x43004300, _ASM_BF16)
    else:
        w0, w1, w2, w3, w4, w5, w6, w7 = _nibbles16_asm(words, zz, HAS_ZEROS, 0x64006400, _ASM_FP16)
    return (w0.to(X_DTYPE, bitcast=True), w1.to(X_DTYPE, bitcast=True), w2.to(X_DTYPE, bitcast=True),
            w3.to(X_DTYPE, bitcast=True), w4.to(X_DTYPE, bitcast=True), w5.to(X_DTYPE, bitcast=True),
            w6.to(X_DTYPE, bitcast=True), w7.to(X_DTYPE, bitcast=True))


@triton.jit
def _interleave(a, b):
    """`[R, C]` and `[R, C]` -> `[R, 2C]` with column 2i + t from (a, b)[t] column i."""
    return tl.reshape(tl.join(a, b), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def in_k_order(w0, w1, w2, w3, w4, w5, w6, w7):
    """The eight nibble tensors (`[R, C]` each, nibble s of word j at column j) as one `[R, 8C]` tensor in natural K
    order, nibble s of word j at column 8j + s: three rounds of pairwise interleaving (s with s + 4, then s with
    s + 2, then even with odd s), each doubling the column index and adding the next lower bit of s."""
    even = _interleave(_interleave(w0, w4), _interleave(w2, w6))
    odd = _interleave(_interleave(w1, w5), _interleave(w3, w7))
    return _interleave(even, odd)
