"""Paged attention over a flat batch mixing prefill chunks and decodes.

Cache layout per layer: `k_cache`, `v_cache` are `[num_blocks, block_size, num_kv_heads, head_size]`
(bf16/fp16/fp32, or float8_e4m3fn with per-tensor `k_scale`/`v_scale`: stored = value / scale).
Per call: any `scale` (1/sqrt(head_size), Gemma's query_pre_attn_scalar^-1/2, ...), an optional sliding window
and an optional logit soft cap (Gemma 2: scaled scores become `cap * tanh(scores / cap)` before masking).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from kestrel.kernels import common


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    logit_soft_cap: float | None = None,
    causal_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: q `[num_tokens, num_heads, head_size]` -> out of the same shape and dtype.

    Query row i of a sequence with context length L and query length Lq sits at position
    L - Lq + i and attends to keys at positions p with p <= its position (and, with a sliding
    window W, p > position - W). With `causal_ends` (int32 `[num_tokens]`, each > the row's position and
    <= L), row t attends to keys p < causal_ends[t] instead: the keys after it up to that end too (an image's
    placeholders seeing their whole image), the window's lower bound unchanged. Scores are `q . k * scale`,
    then `cap * tanh(score / cap)` with a `logit_soft_cap`. Computed in float32 (float64 if q is float64).
    """
    _check_soft_cap(logit_soft_cap)
    num_tokens, num_heads, head_size = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[s, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].to(compute_dtype) * k_scale
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].to(compute_dtype) * v_scale
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        qs = q[q_start:q_end].to(compute_dtype)  # [Lq, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if logit_soft_cap is not None:
            scores = torch.tanh(scores / logit_soft_cap) * logit_soft_cap
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        if causal_ends is None:
            allowed = k_pos <= q_pos
        else:
            allowed = k_pos < causal_ends[q_start:q_end].to(q.device).long().unsqueeze(1)
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def _check_soft_cap(logit_soft_cap: float | None) -> None:
    if logit_soft_cap is not None and not logit_soft_cap > 0:
        raise ValueError(f"logit_soft_cap must be positive, got {logit_soft_cap}")


# ------------------------------------------------------------------------------------------------ Triton
#
# Two launches of one kernel cover a flat batch:
# - "decode" launch, grid (num_seqs, num_kv_heads, num_splits): one program per sequence whose query is at
#   most BLOCK_Q tokens (decodes, short speculative chunks). With num_splits > 1 (flash-decoding) each
#   program covers one slice of the context and writes a partial (output, log-sum-exp) that
#   `_merge_splits_kernel` combines; with the launch feature `attention_split_merge`, the last split of a
#   (sequence, KV head) to finish merges them instead, and a chosen split count is a ceiling: a sequence uses the
#   splits its keys fill.
# - "prefill" launch, grid (num_tokens // BLOCK_Q + num_seqs, num_kv_heads): an upper bound on the number
#   of BLOCK_Q-token query tiles; each program finds its sequence by binary search over query_start_loc,
#   so the grid depends on tensor shapes only and nothing is read back to the host.
# In both, the query heads sharing one KV head are packed into the rows of one tile (row r is query token
# r // GROUP, head r % GROUP), so each K/V tile is loaded once for the whole group.

_LOG2E = 1.4426950408889634
# P (at most 1) enters the FP8 P @ V dot times 2^8: e4m3's normal range then reaches down to p = 2^-14, and its
# largest value, 448, is never passed. The factor is taken in the exponent (exp2(s - m + 8)), not by a multiply per
# probability, and the row sums carry it too.
FP8_P_LOG2_SCALE = tl.constexpr(8.0)
FP8_P_SCALE = tl.constexpr(256.0)
# FP8_DOTS of the prefill launch: 0 off, 1 on, or on with the raw scores scaled inside the exponent's FMA (launch
# feature `fp8_dots_scores_in_exp`)
_FP8_DOTS_SCORES_IN_EXP = tl.constexpr(2)
# FP8 dots reduce over at least common.FP8_DOT_MIN_K: head dims for q @ k^T, keys per tile for P @ V.
FP8_DOT_MIN_K = common.FP8_DOT_MIN_K
# The FP8 dots pay on long steps only (H100, 32 / 8 heads of 128, eager forward, FP8 dots off -> on per layer: 8k
# tokens: attention 1,332 -> 1,013 us, K/V write and staging 150 -> 215 us; 128 tokens: 15 -> 31 us and 4.4 -> 7.5
# us; the kernel bench: about even at 1k, 41 us faster at 4k against 32 us more staging): on a GPU a step of fewer
# tokens stages for fp16 dots.
FP8_DOTS_MIN_TOKENS = 4096
# V_PAIRS (an e4m3 V read as int16 words of two values, see _attend_tiles): P @ V as two dots, over the even and
# over the odd head dims, or as one dot over the words' values joined back into head order. The prefill launch joins
# them for heads under 128: a wgmma whose B operand is 32 wide (64-byte swizzle) read past the CTA's shared memory
# under Triton 3.6 on an H100 (compute-sanitizer: an invalid __shared__ read in the odd dot; heads of 64 with an FP8
# cache faulted with "an illegal memory access"), while the 64-wide halves of heads of 128 run apart, as tuned.
_PAIRS_APART = tl.constexpr(1)
_PAIRS_JOINED = tl.constexpr(2)
_MIN_PAIR_DOT_N = 64
# The decode launch's tiles (16 rows, mma.sync) keep the halves apart, as tuned; a group of more than 32 query heads
# per KV head raises its rows to a wgmma tile, which joins them too.
_WGMMA_MIN_ROWS = 64
_NO_LIMIT = 2**31 - 1  # the prefill launch takes every query length above the decode launch's
_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True)
class AttnConfig:
    """Tile shape of one launch: BLOCK_M packed query rows (tokens x group heads) by BLOCK_N keys."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@triton.jit
def _e4m3_bits_to_f16(b):
    """An e4m3 byte (int32 in [0, 256)) as fp16, exactly: sign and the 7 low bits shifted into fp16's fields give
    the value times 2^-8 (normals and subnormals alike; 0x7f, e4m3's NaN, is never stored: writes clamp)."""
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return (bits.to(tl.int16).to(tl.float16, bitcast=True) * 256.0).to(tl.float16)


@triton.jit
def _e4m3_pairs_to_f16(w, ASM: tl.constexpr):
    """Int16 words holding two e4m3 values (low byte: the even head dim) -> (even, odd) fp16 tensors."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }", "=h,=h,h", [w],
            dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        u = w.to(tl.int32) & 0xFFFF
        lo = _e4m3_bits_to_f16(u & 0xFF)
        hi = _e4m3_bits_to_f16(u >> 8)
    return lo, hi


@triton.jit
def _to_e4m3(x, dot_dtype: tl.constexpr):
    """x (fp32, |x| <= 448) as an FP8 dot operand: e4m3 on the GPU, its e4m3 value in fp32 in the interpreter (whose
    own e4m3 conversion drops a carry into the exponent: 125.8 became 64)."""
    if dot_dtype == tl.float32:
        return common.round_e4m3(x)
    else:
        return x.to(dot_dtype)


@triton.jit
def _softmax_step(q, k, qk_scale, tok, tok_ok, row_pos, row_end, window, m_i, l_i, acc, acc_odd,
                  MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
                  V_PAIRS: tl.constexpr, SOFT_CAP: tl.constexpr, P_LOG2_SCALE: tl.constexpr = 0.0,
                  SCORES_IN_EXP: tl.constexpr = False):
    """One key tile's scores (q @ k^T, the soft cap, the masks of a MASKED tile) into the online softmax: the
    tile's probabilities (times 2^P_LOG2_SCALE) and the running max, sum and accumulators rescaled to them.

    P_LOG2_SCALE != 0 (the FP8 dots): `qk_scale` holds each row's scale ([BLOCK_M], positive). With SCORES_IN_EXP
    and no soft cap, the raw scores go into the exponent's FMA, s * scale - m, and the running max is taken over
    the raw scores times the row's scale (the same value: the scale is positive): no multiply per score."""
    SCALE_IN_EXP: tl.constexpr = SCORES_IN_EXP & (P_LOG2_SCALE != 0.0) & (SOFT_CAP == 0)
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PREC)
    if P_LOG2_SCALE != 0.0:
        row_scale = qk_scale[:, None]
    else:
        row_scale = qk_scale
    if SCALE_IN_EXP:
        qk = s
    else:
        qk = s * row_scale
        if SOFT_CAP > 0:
            qk = SOFT_CAP - (2.0 * SOFT_CAP) / (tl.math.exp2(qk) + 1.0)
    if MASKED:
        visible = tok_ok[None, :] & (tok[None, :] < row_end[:, None])
        if USE_WINDOW:
            visible = visible & (tok[None, :] > row_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    if SCALE_IN_EXP:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
    if MASKED:
        # a row that has seen no key yet keeps m = -inf; subtracting 0 keeps exp2 at 0, not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    if SCALE_IN_EXP:
        p = tl.math.exp2(qk * row_scale - (m_use - P_LOG2_SCALE)[:, None])
    else:
        p = tl.math.exp2(qk - (m_use - P_LOG2_SCALE)[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if V_PAIRS == _PAIRS_APART:
        acc_odd = acc_odd * alpha[:, None]
    return p, m_new, l_i, acc, acc_odd


@triton.jit
def _pairs_dot(p, v_even, v_odd, acc, acc_odd, V_PAIRS: tl.constexpr, DOT_DTYPE: tl.constexpr,
               DOT_PREC: tl.constexpr):
    """P @ V over V's even and odd head dims: into `acc` and `acc_odd` apart (_PAIRS_APART), or as one dot over
    them joined back into head order, into `acc` alone (_PAIRS_JOINED)."""
    p_dot = p.to(DOT_DTYPE)  # fp16 on the GPU (a no-op for the values); fp32 in the interpreter
    if V_PAIRS == _PAIRS_JOINED:
        v = tl.reshape(tl.join(v_even, v_odd), [v_even.shape[0], 2 * v_even.shape[1]])
        acc = tl.dot(p_dot, v.to(DOT_DTYPE), acc, input_precision=DOT_PREC)
    else:
        acc = tl.dot(p_dot, v_even.to(DOT_DTYPE), acc, input_precision=DOT_PREC)
        acc_odd = tl.dot(p_dot, v_odd.to(DOT_DTYPE), acc_odd, input_precision=DOT_PREC)
    return acc, acc_odd


@triton.jit
def _attend_tiles(acc, acc_odd, m_i, l_i, q, k_base, v_base, bt_row, stride_kb, stride_kt, stride_vb, stride_vt,
                  offs_n, offs_d, offs_w, d_ok, row_pos, row_end, start, num_tiles, seg_hi, window, qk_scale,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
                  USE_WINDOW: tl.constexpr, HEAD_MASK: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  DOT_PREC: tl.constexpr, V_PAIRS: tl.constexpr, V_ASM: tl.constexpr, SOFT_CAP: tl.constexpr):
    """Online-softmax over `num_tiles` key tiles from `start`; MASKED tiles apply the sequence end
    (`seg_hi`), each row's end of visible keys (`row_end`: its position + 1, or past it inside an image that
    attends to itself both ways) and the window, the others are known to be fully visible to every row.

    V_PAIRS (FP8 cache): V is read as int16 words of two e4m3 values and P @ V runs over the even and the odd head
    dims (`_pairs_dot`). Read as bytes, the PV operand needs a transposed 8-bit load,
    which Triton emits as one shared-memory load per byte; words transpose with ldmatrix like 16-bit data.

    SOFT_CAP (0: none) is cap * log2(e), and then `qk_scale` carries 2 log2(e) / cap, so exp2(qk) =
    exp(2 s / cap) for the scaled score s: tanh(x) = 1 - 2 / (exp(2x) + 1) (saturating to +-1, never NaN) times
    SOFT_CAP is the capped score in the log2 domain of the softmax."""
    for i in range(num_tiles):
        tok = start + i * BLOCK_N + offs_n
        tok_ok = tok < seg_hi  # read by MASKED tiles only
        if MASKED:
            blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
            kv_mask = tok_ok[:, None] & d_ok[None, :]
        else:
            blk = tl.load(bt_row + tok // BLOCK_SIZE).to(tl.int64)
            kv_mask = d_ok[None, :]
        in_blk = tok % BLOCK_SIZE
        k_ptrs = k_base + (blk * stride_kb + in_blk * stride_kt)[:, None] + offs_d[None, :]
        v_ptrs = v_base + (blk * stride_vb + in_blk * stride_vt)[:, None] + offs_d[None, :]
        if MASKED or HEAD_MASK:
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_ptrs)
        p, m_new, l_i, acc, acc_odd = _softmax_step(q, k, qk_scale, tok, tok_ok, row_pos, row_end, window, m_i, l_i,
                                                    acc, acc_odd, MASKED, USE_WINDOW, DOT_DTYPE, DOT_PREC, V_PAIRS,
                                                    SOFT_CAP)
        if V_PAIRS:
            w_ptrs = v_base + (blk * stride_vb + in_blk * stride_vt)[:, None] + offs_w[None, :]
            if MASKED:
                w = tl.load(w_ptrs, mask=tok_ok[:, None], other=0)
            else:
                w = tl.load(w_ptrs)
            v_even, v_odd = _e4m3_pairs_to_f16(w, V_ASM)
            acc, acc_odd = _pairs_dot(p, v_even, v_odd, acc, acc_odd, V_PAIRS, DOT_DTYPE, DOT_PREC)
        else:
            if MASKED or HEAD_MASK:
                # masked, not just zero-weighted: 0 * NaN from an unwritten slot would poison acc
                v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
            else:
                v = tl.load(v_ptrs)
            acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, acc_odd, m_i, l_i


@triton.jit
def _attend_new_tiles(acc, acc_odd, m_i, l_i, q, k_desc, v_desc, row_of_ctx, kv_col, offs_n, row_pos, row_end,
                      start, num_tiles, key_lo, seg_hi, window, qk_scale, BLOCK_N: tl.constexpr, HEAD: tl.constexpr,
                      MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr,
                      DOT_PREC: tl.constexpr, V_PAIRS: tl.constexpr, SOFT_CAP: tl.constexpr,
                      FP8_DOTS: tl.constexpr):
    """`_attend_tiles` over the step's own keys, read whole-tile through tensor descriptors from the staged K/V
    (`[tokens, kv_heads * HEAD]`, key position p of the sequence at row `row_of_ctx + p`) instead of through the
    block table. Rows past the tensor read as zeros; the MASKED tile zeroes V past `seg_hi` (another sequence's
    rows: 0 * NaN would poison acc), with FP8_DOTS also keys below `key_lo`. V_PAIRS: the staged V holds each head's
    even dims, then its odd ones.

    FP8_DOTS: the staged K/V are the cache's e4m3 values (V transposed: `[kv_heads * HEAD, tokens]`), `q` is e4m3
    (scaled per row: `qk_scale` holds each row's scale) and P goes into its dot as e4m3 times FP8_P_SCALE, so `acc`
    sums FP8_P_SCALE * P @ V and `l_i` FP8_P_SCALE * P. The staged values are all written ones (finite: writes
    clamp) or the descriptor's zeros, so V is not masked."""
    for i in range(num_tiles):
        key0 = start + i * BLOCK_N
        row = row_of_ctx + key0
        tok = key0 + offs_n
        k = k_desc.load([row, kv_col])
        tok_ok = tok < seg_hi  # read by MASKED tiles only
        if FP8_DOTS:  # only its aligned head tile starts below the sequence's first key (key_lo)
            tok_ok = tok_ok & (tok >= key_lo)
        p, m_new, l_i, acc, acc_odd = _softmax_step(q, k, qk_scale, tok, tok_ok, row_pos, row_end, window, m_i, l_i,
                                                    acc, acc_odd, MASKED, USE_WINDOW, DOT_DTYPE, DOT_PREC, V_PAIRS,
                                                    SOFT_CAP, FP8_P_LOG2_SCALE if FP8_DOTS else 0.0,
                                                    FP8_DOTS == _FP8_DOTS_SCORES_IN_EXP)
        if FP8_DOTS:
            v = tl.trans(v_desc.load([kv_col, row])).to(DOT_DTYPE)
            acc = tl.dot(_to_e4m3(p, DOT_DTYPE), v, acc, input_precision=DOT_PREC)
        elif V_PAIRS:
            v_even = v_desc.load([row, kv_col])
            v_odd = v_desc.load([row, kv_col + HEAD // 2])
            if MASKED:
                v_even = tl.where(tok_ok[:, None], v_even, 0.0)
                v_odd = tl.where(tok_ok[:, None], v_odd, 0.0)
            acc, acc_odd = _pairs_dot(p, v_even, v_odd, acc, acc_odd, V_PAIRS, DOT_DTYPE, DOT_PREC)
        else:
            v = v_desc.load([row, kv_col])
            if MASKED:
                v = tl.where(tok_ok[:, None], v, 0.0)
            acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, acc_odd, m_i, l_i


@triton.jit
def _attend_range(acc, acc_odd, m_i, l_i, q, gathered, k_new_desc, v_new_desc, row_of_ctx, kv_col, offs_n, row_pos,
                  row_end, lo, hi, full_hi, window, qk_scale, STAGED: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, USE_WINDOW: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, V_PAIRS: tl.constexpr, V_ASM: tl.constexpr,
                  SOFT_CAP: tl.constexpr, FP8_DOTS: tl.constexpr = 0):
    """Keys [lo, hi): the tiles below `full_hi`, which every row sees, unmasked (none under a window), then the rest
    masked; gathered through the block table (`gathered`: `_attend_tiles`' cache arguments), or STAGED from the
    staged rows (`_attend_new_tiles`)."""
    num_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    if USE_WINDOW:
        num_full = 0
    else:
        num_full = tl.maximum(tl.minimum(hi, full_hi) - lo, 0) // BLOCK_N
    for masked in tl.static_range(2):
        start = lo + masked * num_full * BLOCK_N
        count = num_tiles - num_full if masked else num_full
        if STAGED:
            acc, acc_odd, m_i, l_i = _attend_new_tiles(
                acc, acc_odd, m_i, l_i, q, k_new_desc, v_new_desc, row_of_ctx, kv_col, offs_n, row_pos, row_end,
                start, count, 0, hi, window, qk_scale, BLOCK_N, HEAD, masked == 1, USE_WINDOW, DOT_DTYPE, DOT_PREC,
                V_PAIRS, SOFT_CAP, FP8_DOTS)
        else:
            k_base, v_base, bt_row, stride_kb, stride_kt, stride_vb, stride_vt, offs_d, offs_w, d_ok = gathered
            acc, acc_odd, m_i, l_i = _attend_tiles(
                acc, acc_odd, m_i, l_i, q, k_base, v_base, bt_row, stride_kb, stride_kt, stride_vb, stride_vt, offs_n,
                offs_d, offs_w, d_ok, row_pos, row_end, start, count, hi, window, qk_scale, BLOCK_N, BLOCK_SIZE,
                masked == 1, USE_WINDOW, HEAD != HEAD_PAD, DOT_DTYPE, DOT_PREC, V_PAIRS, V_ASM, SOFT_CAP)
    return acc, acc_odd, m_i, l_i


# A step's metadata (token offsets, lengths, block tables) are slices at any offset and the block table's width
# differs between the start-up's memory profile and serving: specialized on them, the launch compiled again in the
# middle of serving (a full-load run paid 7 s of compiles inside its timed window).
@triton.jit(do_not_specialize=["num_seqs", "q_len_lo", "q_len_hi", "window", "min_keys", "stride_bt"],
            do_not_specialize_on_alignment=["qsl_ptr", "seq_lens_ptr", "bt_ptr", "ends_ptr"])
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, po_ptr, plse_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, ends_ptr, lock_ptr,
    k_new_desc, v_new_desc, qk_scale, v_scale, window, num_seqs, q_len_lo, q_len_hi, min_keys,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PER_SEQ: tl.constexpr, SPLIT: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr, Q_CLAMP: tl.constexpr, V_PAIRS: tl.constexpr, V_ASM: tl.constexpr,
    ACC_W: tl.constexpr, ODD_W: tl.constexpr, SOFT_CAP: tl.constexpr, USE_ENDS: tl.constexpr,
    FUSED_MERGE: tl.constexpr, USE_PDL: tl.constexpr, NEW_KV: tl.constexpr, FP8_DOTS: tl.constexpr,
    FP8_DOT_DTYPE: tl.constexpr,
):
    """NEW_KV (the prefill launch, not SPLIT): keys at the positions of the step's own tokens are read from the
    staged K/V descriptors (`_attend_new_tiles`), the sequence's earlier keys from the cache.

    FP8_DOTS (with NEW_KV, over an e4m3 cache): the staged keys' dots run in FP8 (FP8_DOT_DTYPE: e4m3 on the GPU,
    fp32 over e4m3 values in the interpreter); each query row is scaled to e4m3's range by its own absolute max.
    The cached keys before them keep their 16-bit dots. FP8_DOTS == _FP8_DOTS_SCORES_IN_EXP: the scores' scale taken
    in the exponent's FMA (`_softmax_step`).

    SPLIT with FUSED_MERGE: a (sequence, KV head) uses as many of the launch's splits as its keys fill at
    `min_keys` each (the rest return at once); one split writes the output itself, several write partials and
    the last to arrive at the pair's counter merges them (acq_rel, so it sees every partial) and zeroes the
    counter."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    kv_head = tl.program_id(1)
    if PER_SEQ:
        seq = tl.program_id(0)
        q_block = 0
    else:
        # Heaviest tiles (the last query tiles of the last sequence) first, to shorten the tail.
        pid = tl.num_programs(0) - 1 - tl.program_id(0)
        # Sequence s owns tiles [qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1): find the last s
        # whose first tile is <= pid.
        lo = num_seqs * 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
            below = first <= pid
            lo = tl.where(below, mid + 1, lo)
            hi = tl.where(below, hi, mid)
        seq = lo - 1
        q_block = pid - (tl.load(qsl_ptr + seq) // BLOCK_Q + seq)

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if (q_len <= q_len_lo) | (q_len > q_len_hi):
        return
    q_tok0 = q_block * BLOCK_Q
    if q_tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # position of the sequence's first query token

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD
    tok_in = q_tok0 + offs_m // GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok_in < q_len)
    head = kv_head * GROUP + offs_m % GROUP
    row_pos = ctx + tok_in
    if USE_ENDS:
        row_end = tl.load(ends_ptr + q_start + tok_in, mask=row_ok, other=0)
        row_end = tl.where(row_ok, row_end, row_pos + 1)
    else:
        row_end = row_pos + 1

    q_ptrs = q_ptr + (q_start + tok_in)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if Q_CLAMP:  # bf16 queries into fp16 dots (FP8 cache): keep them finite
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0)
    q = q.to(DOT_DTYPE)

    # Keys [lo, hi) can matter to this tile; those below full_hi are visible to every row.
    last_tok = tl.minimum(q_tok0 + BLOCK_Q, q_len) - 1
    hi = ctx + last_tok + 1
    if USE_ENDS:  # a row may see keys after the tile's last row, never past the context
        hi = tl.minimum(tl.maximum(hi, tl.max(row_end, 0)), seq_len)
    full_hi = ctx + q_tok0 + 1
    if USE_WINDOW:
        lo = tl.maximum(ctx + q_tok0 - window + 1, 0)
    else:
        lo = 0
    if SPLIT:
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)
        if FUSED_MERGE:
            num_splits = tl.minimum(tl.maximum(tl.cdiv(hi - lo, min_keys), 1), num_splits)
            if split >= num_splits:
                return
        per_split = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
        seg_lo = lo + split * per_split
        seg_hi = tl.minimum(seg_lo + per_split, hi)
    else:
        seg_lo = lo
        seg_hi = hi

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    # With V_PAIRS == _PAIRS_APART, acc holds the even head dims and acc_odd the odd ones (ACC_W = ODD_W =
    # HEAD_PAD / 2); otherwise acc is the whole row and acc_odd an unused column.
    acc = tl.zeros([BLOCK_M, ACC_W], tl.float32)
    acc_odd = tl.zeros([BLOCK_M, ODD_W], tl.float32)
    if V_PAIRS:
        offs_w = tl.arange(0, HEAD_PAD // 2)
    else:
        offs_w = tl.arange(0, HEAD_PAD)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    gathered = (k_base, v_base, bt_row, stride_kb, stride_kt, stride_vb, stride_vt, offs_d, offs_w, d_ok)
    # With NEW_KV the block table gives the cached keys [seg_lo, ctx) only (every row sees them, full_hi > ctx; one
    # tile may end inside), and the staged rows the step's own [ctx, seg_hi).
    gathered_hi = tl.minimum(ctx, seg_hi) if NEW_KV else seg_hi
    acc, acc_odd, m_i, l_i = _attend_range(
        acc, acc_odd, m_i, l_i, q, gathered, None, None, 0, 0, offs_n, row_pos, row_end, seg_lo, gathered_hi, full_hi,
        window, qk_scale, False, BLOCK_N, BLOCK_SIZE, HEAD, HEAD_PAD, USE_WINDOW, DOT_DTYPE, DOT_PREC, V_PAIRS,
        V_ASM, SOFT_CAP)
    new_lo = tl.maximum(seg_lo, ctx)
    row_of_ctx = q_start - ctx  # the staged row of the sequence's key position 0
    kv_col = kv_head * HEAD
    if FP8_DOTS:
        if V_PAIRS == _PAIRS_APART:
            acc = tl.reshape(tl.join(acc, acc_odd), [BLOCK_M, HEAD_PAD])
        acc = acc * FP8_P_SCALE
        l_i = l_i * FP8_P_SCALE
        q = q.to(tl.float32)
        q_amax = tl.max(tl.abs(q), 1)
        q_row_scale = tl.where(q_amax > 0.0, q_amax / 448.0, 1.0)
        q = _to_e4m3(tl.clamp(q / q_row_scale[:, None], -448.0, 448.0), FP8_DOT_DTYPE)
        row_scale = q_row_scale * qk_scale
        # A tile of the transposed V starts at a 16-byte-aligned column (TMA): where the sequence's first staged key
        # lies inside one, that tile is attended alone, masked below the key, and the rest from the next
        head_keys = (row_of_ctx + new_lo) % 16
        aligned_lo = new_lo - head_keys
        acc, acc_odd, m_i, l_i = _attend_new_tiles(
            acc, acc_odd, m_i, l_i, q, k_new_desc, v_new_desc, row_of_ctx, kv_col, offs_n, row_pos, row_end,
            aligned_lo, tl.where((head_keys > 0) & (new_lo < seg_hi), 1, 0), new_lo, seg_hi, window,
            row_scale, BLOCK_N, HEAD, True, USE_WINDOW, FP8_DOT_DTYPE, DOT_PREC, False, SOFT_CAP, FP8_DOTS)
        acc, acc_odd, m_i, l_i = _attend_range(
            acc, acc_odd, m_i, l_i, q, gathered, k_new_desc, v_new_desc, row_of_ctx, kv_col, offs_n,
            row_pos, row_end, tl.where(head_keys > 0, aligned_lo + BLOCK_N, new_lo), seg_hi, full_hi, window,
            row_scale, True, BLOCK_N, BLOCK_SIZE, HEAD, HEAD_PAD, USE_WINDOW, FP8_DOT_DTYPE, DOT_PREC, False, V_ASM,
            SOFT_CAP, FP8_DOTS)
    else:
        if NEW_KV:
            acc, acc_odd, m_i, l_i = _attend_range(
                acc, acc_odd, m_i, l_i, q, gathered, k_new_desc, v_new_desc, row_of_ctx, kv_col, offs_n,
                row_pos, row_end, new_lo, seg_hi, full_hi, window, qk_scale, True, BLOCK_N, BLOCK_SIZE, HEAD,
                HEAD_PAD, USE_WINDOW, DOT_DTYPE, DOT_PREC, V_PAIRS, V_ASM, SOFT_CAP)
        if V_PAIRS == _PAIRS_APART:
            acc = tl.reshape(tl.join(acc, acc_odd), [BLOCK_M, HEAD_PAD])

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc * (v_scale / l_safe)[:, None]
    o_ptrs = out_ptr + (q_start + tok_in)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    o_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        if FUSED_MERGE and num_splits == 1:
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            # partials [launch splits, num_seqs, num_kv_heads, BLOCK_M, HEAD_PAD] and lse [..., BLOCK_M]
            pair = seq * tl.num_programs(1) + kv_head
            rows = (split * num_seqs * tl.num_programs(1) + pair).to(tl.int64) * BLOCK_M + offs_m
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
            tl.store(plse_ptr + rows, lse)
            tl.store(po_ptr + rows[:, None] * HEAD_PAD + offs_d[None, :], o)
            if FUSED_MERGE:  # noqa: SIM102 - a constexpr gate: no arrival counted (an atomic) where it is off
                if common.last_arrival(lock_ptr + pair, num_splits):
                    merged = _merge_pair(po_ptr, plse_ptr, pair, num_seqs * tl.num_programs(1), num_splits,
                                         offs_m, offs_d, BLOCK_M, HEAD_PAD)
                    tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=o_mask)
                    tl.atomic_xchg(lock_ptr + pair, 0)
    else:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _merge_pair(po_ptr, plse_ptr, pair, pairs, num_splits, offs_m, offs_d, BLOCK_M: tl.constexpr,
                HEAD_PAD: tl.constexpr):
    """A (sequence, KV head) pair's `[BLOCK_M, HEAD_PAD]` output from its `num_splits` partials, as
    `common.merge_splits` weighs them (2^(lse - the largest); no key anywhere: 0). Loads bypass L1: the
    partials were written by other programs."""
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(num_splits):
        rows = (s * pairs + pair).to(tl.int64) * BLOCK_M + offs_m
        top = tl.maximum(top, tl.load(plse_ptr + rows, cache_modifier=".cg"))
    base = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for s in range(num_splits):
        rows = (s * pairs + pair).to(tl.int64) * BLOCK_M + offs_m
        weight = tl.math.exp2(tl.load(plse_ptr + rows, cache_modifier=".cg") - base)
        total += weight
        acc += weight[:, None] * tl.load(po_ptr + rows[:, None] * HEAD_PAD + offs_d[None, :], cache_modifier=".cg")
    return acc / tl.where(total == 0.0, 1.0, total)[:, None]


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "q_len_hi"])
def _merge_splits_kernel(
    out_ptr, po_ptr, plse_ptr, qsl_ptr, num_seqs, num_splits, q_len_hi, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, SPLITS_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per packed row (sequence, KV head, row): every split's partial is loaded in one
    [SPLITS_PAD, HEAD_PAD] tile, so the merge costs one memory round trip rather than one per split."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    r = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    tok = r // GROUP
    if (q_len <= 0) | (q_len > q_len_hi) | (tok >= q_len):
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_ok = offs_s < num_splits
    row = ((offs_s * num_seqs + seq) * tl.num_programs(1) + kv_head).to(tl.int64) * BLOCK_M + r
    o = common.merge_splits(plse_ptr, po_ptr, row, s_ok, offs_d, HEAD_PAD)
    head = kv_head * GROUP + r % GROUP
    tl.store(out_ptr + (q_start + tok) * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD)


# ------------------------------------------------------------------------------------------------ launcher

# Tile configs per head size (padded to a power of two). Head size 128 was swept on the H200
# (benchmarks/results/attention-h200.json, "decode_config_sweep" / "prefill_config_sweep"; the sum over
# sweep points of time / best time, 4.0 is ideal for 4 points):
#   decode BF16: (16, 64, 4, 2) 4.04 | (16, 128, 4, 2) 4.07 | (16, 32, 4, 6) 4.06 | (16, 64, 4, 3) 4.37
#     e.g. 256 x 8k: 1942 us (4.43 TB/s) against 2110 us with 3 stages (1 K/V buffer, more registers)
#   decode FP8: (16, 128, 4, 5) 4.03 | (16, 128, 4, 2) 4.10 | (16, 64, 4, 5) 4.33 | (16, 256, 8, 3) 6.0
#     two K/V buffers (5 stages) pay here: 256 x 8k 1500 us against 1643 us with one
#   prefill: (128, 128, 8, 3) 401 TFLOP/s at 16k | (128, 128, 8, 2) 390 | (128, 64, 8, 4) 353 | (64, 64, 4, 3) 348
# Head sizes 64 and 256 were not timed: their tiles keep the per-tile bytes of the 128 ones and were
# checked to compile for sm_90 without spills (256: fewer rows so the fp32 accumulator fits).
_DECODE_CONFIGS: dict[tuple[int, bool], AttnConfig] = {
    # (head_pad, fp8 cache) -> config; block_m is raised to the group size when a group is larger
    (64, False): AttnConfig(16, 64, 4, 2),
    (64, True): AttnConfig(16, 128, 4, 5),
    (128, False): AttnConfig(16, 64, 4, 2),
    (128, True): AttnConfig(16, 128, 4, 5),
    (256, False): AttnConfig(16, 32, 4, 3),
    (256, True): AttnConfig(16, 64, 4, 2),
}
_PREFILL_CONFIGS: dict[int, AttnConfig] = {
    64: AttnConfig(128, 64, 8, 3),
    128: AttnConfig(128, 128, 8, 3),
    256: AttnConfig(64, 64, 8, 2),
}
# The FP8 dots over staged keys (`stages_fp8`), heads of 128, H100 (the H200's tables), best of four tiles, one causal
# prefill of 32 / 8 heads (log-kernels-h100.txt under benchmarks/results/issue29/prefill-fp8-dots/): 128 x 64 with 4
# warps 886 us at 8k, 3,348 us at 16k; 64 x 64 (4 warps) was best up to 4k (268 us at 4k), 128 x 128 (8 warps) for a
# 2k chunk over 8k of context.
_FP8_DOTS_PREFILL_CONFIGS: dict[int, AttnConfig] = {
    128: AttnConfig(128, 64, 4, 3),
}
# fp32 activations (exact "ieee" dots, tests and debugging): fp32 tiles take twice the shared memory;
# (128, 128, 8, 3) asked for 262 KB of the 227 KB an SM has.
_FP32_DECODE = AttnConfig(16, 32, 4, 2)
_FP32_PREFILL = AttnConfig(32, 32, 4, 2)


@dataclass(frozen=True)
class SplitRule:
    """Split-KV choice: double the splits of each (sequence, KV head) while the decode launch stays within
    `programs_per_sm` programs per SM, up to `max_splits` (`max_splits_blind` when the context length is
    unknown, as in a CUDA graph); with the context length known, keep >= `min_keys` keys per split, and
    use >= `long_splits` splits from `long_context` keys on."""

    programs_per_sm: int
    max_splits: int
    max_splits_blind: int
    min_keys: int
    long_context: int = 0
    long_splits: int = 1


# From the split sweep on the H200 (attention-h200.json "split_sweep", every power of two 1..64 timed at
# batch {1, 16, 64, 256} x context {512, 2k, 4k, 8k, 32k}, 8 KV heads). Best splits, BF16 KV:
#   batch 1: 8 / 16 / 32 / 64 / 64 (512 .. 32k; 32k: 44.5 us at 64, 46.6 at 32, 66.2 at 16, 812 at 1)
#   batch 16: 2 / 4 / 4 / 4 / 4; batch 64 and 256: 1 (4 x 132 SMs = 528 programs already)
# FP8 KV wants about half the programs (its 5-stage tile keeps 2 CTAs per SM, not 4):
#   batch 1: 4 / 16 / 16 / 16 / 32; batch 16: 1 / 2 / 2 / 2 / 2; batch 64/256: 1, 2-4 from 8k on
#   (64 x 32k: 1390 us at 2 splits, 1506 at 1; 256 x 8k: 1449 at 2, 1505 at 1)
# These rules pick the best split or one within 6% of it, except: BF16 1 x 512 blind (32 splits, +20%);
# FP8 1 x 512 / 1 x 2k blind (+16% / +9%), 16 x 512 (+8%), and blind 64 / 256 x 8k-32k (1 split, +2-8%).
_SPLIT_RULES: dict[bool, SplitRule] = {
    False: SplitRule(programs_per_sm=4, max_splits=64, max_splits_blind=32, min_keys=64),
    True: SplitRule(programs_per_sm=2, max_splits=32, max_splits_blind=32, min_keys=128, long_context=8192,
                    long_splits=2),
}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; a nominal 16 elsewhere (the interpreter)."""
    return common.num_sms(device, off_cuda=16)


def decode_config(head_size: int, group: int, fp8: bool, fp32: bool = False) -> AttnConfig:
    head_pad = max(16, _next_pow2(head_size))
    cfg = _FP32_DECODE if fp32 else _DECODE_CONFIGS.get((head_pad, fp8)) or AttnConfig(16, 32, 4, 2)
    return replace(cfg, block_m=max(cfg.block_m, _next_pow2(group)))


def prefill_config(head_size: int, group: int, fp32: bool = False, fp8_dots: bool = False) -> AttnConfig:
    head_pad = max(16, _next_pow2(head_size))
    tuned = (fp8_dots and _FP8_DOTS_PREFILL_CONFIGS.get(head_pad)) or _PREFILL_CONFIGS.get(head_pad)
    cfg = _FP32_PREFILL if fp32 else tuned or AttnConfig(64, 32, 4, 2)
    return replace(cfg, block_m=max(cfg.block_m, _next_pow2(group)))


def choose_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device, max_seq_len: int | None = None,
                      fp8: bool = False) -> int:
    """Splits of the context per (sequence, KV head) for the decode launch, from shapes only (and the
    context length when the caller knows it on the host): see _SPLIT_RULES."""
    return splits_for(num_seqs, num_kv_heads, num_sms(device), max_seq_len, fp8)


def splits_for(num_seqs: int, num_kv_heads: int, sms: int, max_seq_len: int | None, fp8: bool) -> int:
    rule = _SPLIT_RULES[fp8]
    programs = num_seqs * num_kv_heads
    cap = rule.max_splits if max_seq_len is not None else rule.max_splits_blind
    splits = 1
    while programs * splits * 2 <= rule.programs_per_sm * sms and splits < cap:
        splits *= 2
    while max_seq_len is not None and splits > 1 and splits * rule.min_keys > max_seq_len:
        splits //= 2
    if max_seq_len is not None and rule.long_context and max_seq_len >= rule.long_context:
        splits = max(splits, rule.long_splits)
    return splits


def stages_fp8(k_cache: torch.Tensor, num_tokens: int) -> bool:
    """Whether the prefill launch of a step of `num_tokens` over this cache runs its staged keys' dots in FP8
    (FP8_DOTS): an e4m3 cache of heads of at least FP8_DOT_MIN_K dims, with the launch feature `prefill_fp8_dots`
    on, and on a GPU a step of at least FP8_DOTS_MIN_TOKENS. Its staged K/V are then the cache's own e4m3 values, V
    transposed (`new_staged_kv`): FP8 P @ V takes V with the keys contiguous, which Triton would otherwise transpose
    in the kernel (half the speed of fp16 dots, measured)."""
    min_tokens = FP8_DOTS_MIN_TOKENS if k_cache.is_cuda else 0
    return (k_cache.dtype == torch.float8_e4m3fn and k_cache.shape[-1] >= FP8_DOT_MIN_K
            and num_tokens >= min_tokens and common.launch_feature("prefill_fp8_dots", k_cache.device))


def staged_kv_dtype(k_cache: torch.Tensor, num_tokens: int) -> torch.dtype:
    """The dtype a step's own keys and values are staged in for the prefill launch (`new_kv`): the cache's own,
    or fp16 for an FP8 cache whose staged dots run in fp16 (every e4m3 value exactly; see `stages_fp8`)."""
    if k_cache.dtype == torch.float8_e4m3fn and not stages_fp8(k_cache, num_tokens):
        return torch.float16
    return k_cache.dtype


def stages_v_in_pairs(k_cache: torch.Tensor, num_tokens: int) -> bool:
    """Whether a step's staged V holds each head's even dims first, then its odd ones: over an FP8 cache whose staged
    dots run in fp16, where the kernel accumulates V's even and odd dims apart (V_PAIRS)."""
    return k_cache.dtype == torch.float8_e4m3fn and not stages_fp8(k_cache, num_tokens)


def _staged_width(k_cache: torch.Tensor) -> int:
    return k_cache.shape[2] * k_cache.shape[3]


def _padded_tokens(num_tokens: int) -> int:
    """Columns of a transposed staged V: its rows 16-byte aligned, as tensor descriptors read them."""
    return -(-num_tokens // 16) * 16


def new_staged_kv(num_tokens: int, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty staged K (`[tokens, kv_heads * head]`) and V (the same, or `[kv_heads * head, tokens]` with its rows
    padded where `stages_fp8`) for a step of `num_tokens` over `k_cache`, which `rope_store_kv(..., staged=...)`
    fills."""
    width, dtype = _staged_width(k_cache), staged_kv_dtype(k_cache, num_tokens)
    k = torch.empty((num_tokens, width), dtype=dtype, device=k_cache.device)
    if stages_fp8(k_cache, num_tokens):
        v = torch.empty((width, _padded_tokens(num_tokens)), dtype=dtype, device=k_cache.device)[:, :num_tokens]
    else:
        v = torch.empty((num_tokens, width), dtype=dtype, device=k_cache.device)
    return k, v


def staged_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's own K/V staged as the cache holds them: row t is what slot `slot_mapping[t]` holds (zeros for
    -1), in `staged_kv_dtype`, V's dims per head reordered evens first where `stages_v_in_pairs`, V transposed
    (column t) where `stages_fp8`, in `new_staged_kv`'s layout."""
    _, _, num_kv_heads, head_size = k_cache.shape
    num_tokens = len(slot_mapping)
    dtype = staged_kv_dtype(k_cache, num_tokens)
    slots = slot_mapping.to(k_cache.device).long()
    written = (slots >= 0)[:, None, None]
    staged = []
    for cache in (k_cache, v_cache):
        # gathered through a byte view (index_select and where have no FP8 kernels on every device); zero bytes
        # are zeros in every dtype
        rows = cache.view(torch.uint8).reshape(-1, num_kv_heads, head_size * cache.element_size())[slots.clamp(min=0)]
        rows = torch.where(written, rows, torch.zeros((), dtype=torch.uint8, device=rows.device))
        staged.append(rows.view(cache.dtype).to(dtype).reshape(len(slots), num_kv_heads * head_size))
    k, v = staged
    if stages_v_in_pairs(k_cache, num_tokens):
        per_head = v.view(len(slots), num_kv_heads, head_size)
        v = torch.cat((per_head[..., 0::2], per_head[..., 1::2]), dim=-1).reshape(len(slots), num_kv_heads * head_size)
    if stages_fp8(k_cache, num_tokens):
        transposed = new_staged_kv(num_tokens, k_cache)[1]
        transposed.view(torch.uint8).copy_(v.view(torch.uint8).t())
        v = transposed
    return k, v


def check_staged_kv(staged: tuple[torch.Tensor, torch.Tensor], num_tokens: int, k_cache: torch.Tensor) -> None:
    """Refuse staged K/V that are not `new_staged_kv`'s for this step: the step's rows (V transposed where
    `stages_fp8`) of `staged_kv_dtype`, 16-byte aligned rows (as tensor descriptors read them)."""
    width = _staged_width(k_cache)
    expected = staged_kv_dtype(k_cache, num_tokens)
    shapes = {"k": (num_tokens, width),
              "v": (width, num_tokens) if stages_fp8(k_cache, num_tokens) else (num_tokens, width)}
    for (name, shape), x in zip(shapes.items(), staged):
        aligned = (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0
        if (x.shape != shape or x.stride(-1) != 1 or x.dtype != expected or x.device != k_cache.device
                or not aligned):
            raise ValueError(f"staged {name} {tuple(x.shape)} {x.dtype} on {x.device} (strides {x.stride()}) is not "
                             f"the step's {list(shape)} {expected} on {k_cache.device}, 16-byte aligned rows with a "
                             "contiguous last dimension (ops.new_staged_kv makes them)")


def reads_staged_kv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether a prefill launch over these caches reads staged K/V (`new_kv`): a power-of-two head, 16-bit dots
    (a GPU's float32 activations keep the gathered path), TMA on a GPU (Hopper or newer, with the launch feature
    `prefill_new_kv` on), and over an FP8 cache its V read in pairs (see `_v_in_pairs`)."""
    head_size = k_cache.shape[-1]
    if head_size != _next_pow2(head_size) or head_size < 16:
        return False
    if stages_v_in_pairs(k_cache, q.shape[0]) and not _v_in_pairs(v_cache, head_size):
        return False
    if q.is_cuda:
        return (q.dtype in _DOT_DTYPES and common.is_hopper_or_newer(q.device)
                and common.launch_feature("prefill_new_kv", q.device))
    return True


def _v_in_pairs(v_cache: torch.Tensor, head_size: int) -> bool:
    """An e4m3 V cache read as int16 words of two values (V_PAIRS, see `_attend_tiles`): its head fills the kernel's
    padded head (a power of two, at least 16)."""
    return (v_cache.dtype == torch.float8_e4m3fn and head_size == max(16, _next_pow2(head_size))
            and v_cache.stride(-1) == 1
            and all(st % 2 == 0 for st in v_cache.stride()[:-1]) and v_cache.storage_offset() % 2 == 0)


def _staged_descriptors(new_kv: tuple[torch.Tensor, torch.Tensor], num_tokens: int, k_cache: torch.Tensor,
                        block_n: int, fp8_dots: bool) -> tuple[TensorDescriptor, TensorDescriptor]:
    """Tensor descriptors of the staged K and V (`new_staged_kv`'s) for the prefill launch's key tiles; `fp8_dots`:
    the step's `stages_fp8`."""
    check_staged_kv(new_kv, num_tokens, k_cache)
    k_new, v_new = new_kv
    head_size = k_cache.shape[-1]
    k_desc = TensorDescriptor(k_new, list(k_new.shape), [k_new.stride(0), 1], [block_n, head_size])
    if fp8_dots:  # transposed: a tile is one head's dims by block_n keys
        return k_desc, TensorDescriptor(v_new, list(v_new.shape), [v_new.stride(0), 1], [head_size, block_n])
    v_block = head_size // 2 if stages_v_in_pairs(k_cache, num_tokens) else head_size
    return k_desc, TensorDescriptor(v_new, list(v_new.shape), [v_new.stride(0), 1], [block_n, v_block])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    logit_soft_cap: float | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    decode_cfg: AttnConfig | None = None,
    prefill_cfg: AttnConfig | None = None,
    causal_ends: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Triton paged attention with `paged_attention_ref`'s semantics (`causal_ends` included); no host
    synchronization.

    `new_kv`: the step's own keys and values as the cache holds them, staged in token order (`new_staged_kv`'s
    tensors, which `rope_store_kv(..., staged=...)` fills): the prefill launch reads them whole-tile through tensor
    descriptors (TMA) instead of gathering them from the cache's blocks. Only a hint: ignored where the launch cannot
    use it (`reads_staged_kv`).

    `max_query_len` / `max_seq_len` are optional host-side hints (AttentionMetadata has them):
    `max_query_len` must bound every sequence's query length (a decode CUDA graph can pass 1, a prefill graph
    its token bucket); with it a pure decode batch skips the prefill launch, and a batch of one sequence holding
    more than the decode launch's tokens skips the decode launch. `max_seq_len` only tunes the split count:
    leave it out when capturing a graph replayed at other context lengths. `num_splits`, `decode_cfg`,
    `prefill_cfg` override the tuned choices (tests, benchmarks).
    """
    num_tokens, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, kv_head_size = k_cache.shape
    if num_heads % num_kv_heads or kv_head_size != head_size or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, the caches and block_tables must have a contiguous last dimension")
    _check_soft_cap(logit_soft_cap)
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    head_pad = max(16, _next_pow2(head_size))
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    # Triton's CPU interpreter multiplies bf16 blocks wrongly (numpy has no bf16), so off the GPU the
    # dots run in fp32. On the GPU they run in the activations' 16-bit type, except over an FP8 cache:
    # e4m3 -> fp16 is one instruction per pair (-> bf16 takes two more per element, which made FP8 decode
    # no faster than BF16, measured), and fp16 holds every e4m3 value exactly.
    if not q.is_cuda or q.dtype not in _DOT_DTYPES:
        dot_dtype = tl.float32
    elif fp8:
        dot_dtype = tl.float16
    else:
        dot_dtype = _DOT_DTYPES[q.dtype]
    # The cap is a compile-time constant (one value per model: Gemma 2 caps every layer at 50), so the default
    # path compiles to exactly the uncapped kernel, with no extra parameter.
    qk_scale = float(scale) * float(k_scale) * _LOG2E
    capped = logit_soft_cap is not None
    shared = dict(
        qk_scale=qk_scale * 2.0 / float(logit_soft_cap) if capped else qk_scale, v_scale=float(v_scale),
        SOFT_CAP=float(logit_soft_cap) * _LOG2E if capped else 0.0,
        window=int(sliding_window or 0), num_seqs=num_seqs,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
        stride_kb=k_cache.stride(0), stride_kt=k_cache.stride(1), stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0), stride_vt=v_cache.stride(1), stride_vh=v_cache.stride(2),
        stride_bt=block_tables.stride(0),
        GROUP=group, HEAD=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None, DOT_DTYPE=dot_dtype,
        DOT_PREC="ieee" if dot_dtype == tl.float32 else "tf32",
        Q_CLAMP=dot_dtype == tl.float16 and q.dtype != torch.float16,
        USE_ENDS=causal_ends is not None,
    )
    pdl = common.pdl_options(q, "pdl_decode")
    ends = seq_lens if causal_ends is None else causal_ends
    wide = dot_dtype == tl.float32 and q.is_cuda
    # FP8 (e4m3) V read as int16 pairs, see _attend_tiles; the dots then run in fp16 off the GPU too.
    v_pairs = _v_in_pairs(v_cache, head_size)
    v_arg = v_cache.view(torch.int16) if v_pairs else v_cache
    narrow_halves = v_pairs and head_pad // 2 < _MIN_PAIR_DOT_N

    def pairs_args(joined: bool) -> dict:
        apart = v_pairs and not joined
        mode = int(_PAIRS_APART) if apart else int(_PAIRS_JOINED) if v_pairs else 0
        return dict(V_PAIRS=mode, V_ASM=v_pairs and q.is_cuda, ACC_W=head_pad // 2 if apart else head_pad,
                    ODD_W=head_pad // 2 if apart else 1)

    shared.update(stride_vb=v_arg.stride(0), stride_vt=v_arg.stride(1), stride_vh=v_arg.stride(2))
    dec = decode_cfg or decode_config(head_size, group, fp8, wide)
    dec_q = max(1, dec.block_m // group)

    if num_tokens > dec_q and (max_query_len is None or max_query_len > dec_q):
        reads_staged = new_kv is not None and reads_staged_kv(q, k_cache, v_cache)
        fp8_dots = reads_staged and stages_fp8(k_cache, num_tokens)
        pre = prefill_cfg or prefill_config(head_size, group, wide, fp8_dots)
        pre_q = max(1, pre.block_m // group)
        grid = (num_tokens // pre_q + num_seqs, num_kv_heads)
        staged = (_staged_descriptors(new_kv, num_tokens, k_cache, pre.block_n, fp8_dots) if reads_staged
                  else (None, None))
        if fp8_dots and pre.block_n < FP8_DOT_MIN_K:
            raise ValueError(f"prefill_cfg block_n={pre.block_n}: the FP8 dots over staged keys (launch feature "
                             f"prefill_fp8_dots) take key tiles of at least {FP8_DOT_MIN_K}")
        _paged_attn_kernel[grid](
            q, k_cache, v_arg, out, out, out, query_start_loc, seq_lens, block_tables, ends, out, *staged,
            q_len_lo=dec_q, q_len_hi=_NO_LIMIT, min_keys=1, **shared, **pairs_args(narrow_halves),
            BLOCK_M=pre.block_m, BLOCK_Q=pre_q, BLOCK_N=pre.block_n, PER_SEQ=False, SPLIT=False, FUSED_MERGE=False,
            NEW_KV=reads_staged,
            FP8_DOTS=(_FP8_DOTS_SCORES_IN_EXP if common.launch_feature("fp8_dots_scores_in_exp", q.device) else 1)
            if fp8_dots else 0,
            FP8_DOT_DTYPE=tl.float8e4nv if q.is_cuda else tl.float32,
            num_warps=pre.num_warps, num_stages=pre.num_stages, **pdl,
        )

    if num_seqs == 1 and max_query_len is not None and max_query_len > dec_q and num_tokens == max_query_len:
        # One sequence holds every token and it is not a decode: nothing for the decode launch. With several
        # sequences max_query_len is only a bound (a prefill CUDA graph passes its token bucket), so a row short
        # enough for the decode launch may be among them.
        return out
    # An explicit split count is used as given; a chosen one is a ceiling, each sequence using what its keys fill.
    min_keys = 1
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, q.device, max_seq_len, fp8)
        min_keys = _SPLIT_RULES[fp8].min_keys
    split = num_splits > 1
    fused_merge = (split and num_seqs * num_kv_heads <= common.ARRIVAL_SLOTS
                   and common.launch_feature("attention_split_merge", q.device))
    if split:
        part_o = torch.empty((num_splits, num_seqs, num_kv_heads, dec.block_m, head_pad), dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty(part_o.shape[:-1], dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out
    _paged_attn_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_arg, out, part_o, part_lse, query_start_loc, seq_lens, block_tables, ends,
        common.arrival_counters(q.device) if fused_merge else out, None, None,
        q_len_lo=0, q_len_hi=dec_q, min_keys=min_keys, **shared,
        **pairs_args(narrow_halves and dec.block_m >= _WGMMA_MIN_ROWS),
        BLOCK_M=dec.block_m, BLOCK_Q=dec_q, BLOCK_N=dec.block_n, PER_SEQ=True, SPLIT=split, FUSED_MERGE=fused_merge,
        NEW_KV=False, FP8_DOTS=False, FP8_DOT_DTYPE=tl.float32, num_warps=dec.num_warps, num_stages=dec.num_stages,
        **pdl,
    )
    if split and not fused_merge:
        _merge_splits_kernel[(num_seqs, num_kv_heads, dec_q * group)](
            out, part_o, part_lse, query_start_loc, num_seqs, num_splits, dec_q, out.stride(0), out.stride(1),
            GROUP=group, HEAD=head_size, HEAD_PAD=head_pad, BLOCK_M=dec.block_m, BLOCK_Q=dec_q,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=8 if num_splits > 16 else 4, **pdl,
        )
    return out
