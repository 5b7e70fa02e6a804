"""Query-aware sparse decoding (Quest) over the paged KV cache: per-page key bounds, page selection, and decode
attention over the selected pages.

A page is `page_size` consecutive tokens of one cache block (the block itself when `page_size == block_size`, or
one of its `block_size // page_size` equal parts): the unit that is bounded, selected and read. Finer pages bound
their keys more tightly and spend the token budget on fewer unneeded tokens, at the cost of more bounds.

Three operations, each a Triton kernel with a PyTorch reference of the same signature:
- `update_key_bounds`: after a step's K/V are written, each block written this step gets, per page, the
  elementwise min and max of the page's filled slots' keys, per KV head, as stored (dequantized by `k_scale` for
  an FP8 cache), so the bounds hold exactly for the keys attention reads. The last token a step writes into a
  block recomputes that block's bounds from slot 0 through its own slot (pages past that slot get +inf / -inf,
  the bounds of no key): a block whose first slot is written starts fresh (a reused block keeps nothing of its
  previous owner), and a block the step does not write (a prefix-cache hit) keeps its bounds.
- `quest_select`: per (sequence, KV head), an upper bound of each page's attention score,
  `scale * max over the group's query heads of sum_d max(q_d * min_d, q_d * max_d)`; the pages of the first
  `sink_blocks` blocks' tokens and of the last `recent_blocks * block_size` tokens are always kept, the
  highest-bounded of the rest fill the `num_selected` slots. Out: logical page indices (token // page_size)
  `[num_seqs, num_kv_heads, num_selected]`, ascending, -1 for unused slots; a sequence of at most `num_selected`
  pages selects them all.
  Two Triton paths (`impl`): "stream" (default) streams many pages per program through tensor-core dots (the
  bound is linear in the bounds: `max(q*lo, q*hi) = max(q, 0)*hi + min(q, 0)*lo` for lo <= hi) and selects in
  Triton (a radix select of the k-th score per (sequence, KV head), then one ordered pass that writes the pages
  ascending); "topk" is the earlier path (16 pages a program, torch top-k and sort). Ties at the k-th score go to
  the lower page index in the reference and in "stream" (a stable descending sort there, an ordered scan here),
  so both select the same set from the same scores; "topk" breaks ties as torch.topk does.
- `sparse_paged_decode`: one query token per sequence attends to its selected pages only (the last one masked by
  the sequence length), with split-KV partials for small batches, merged by a Triton kernel ("triton") or torch
  ops ("torch", the earlier path).

Shapes are static (the selection width is fixed, grids depend on shapes only) and nothing reads a tensor back to
the host, so a decode step stays capturable in a CUDA graph.

Layouts: caches `[num_blocks, block_size, num_kv_heads, head_size]`; key bounds
`[num_blocks, block_size // page_size, 2, num_kv_heads, head_size]` (per page: min, then max), of
`key_bounds_dtype(cache dtype)`. Every step reads every page's bounds, so their bytes are the selection's cost:
- An FP8 cache keeps its bounds in its own dtype and units (stored values, before `k_scale`): the min and max of
  FP8 keys are FP8 keys, so they are exact, and half bfloat16's bytes. The selection then scales its scores by
  `k_scale` (`score_scale`). A page with no key holds 0 (FP8 has no infinity; such a page lies past its
  sequence's length, and the scores never read it).
- Other caches keep bfloat16 bounds, half a float32 copy's bytes. Each is widened by 2^-6 of its magnitude in
  float32 and then rounded toward zero to bfloat16 (which loses less than 2^-7 of it), so a stored minimum never
  exceeds the true one and a stored maximum never falls short: the scores stay upper bounds. Rounding toward zero
  is a truncation of the float32 bits, the same in the kernel, its reference and Triton's interpreter, so all
  three store the same bits. A page with no key holds +inf / -inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kestrel.kernels import common

_LOG2E = 1.4426950408889634
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_BOUND_WIDENING = 2.0**-6  # twice a bfloat16's relative spacing: truncation to bfloat16 cannot cross back
_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
SELECT_IMPLS = ("stream", "topk")
MERGE_IMPLS = ("triton", "torch")


@dataclass(frozen=True)
class StreamConfig:
    """Launch shape of the "stream" selection. Scores: `block_b` pages a tile, tiles of one (sequence, KV head)
    split over programs so the launch holds about `programs_per_sm` programs per SM (fewer, longer programs keep
    more bytes in flight than one tile each), `num_stages` tiles in flight per program. Selection: one program per
    (sequence, KV head) reads up to `select_chunk` scores a step (the table width rounded up to a power of two
    when smaller: a row that fits is read once and kept in registers), with `select_warps` warps (None: one per
    512 scores of a step, 4 to 16)."""

    block_b: int = 32
    programs_per_sm: int = 16
    num_warps: int = 4
    num_stages: int = 2
    select_chunk: int = 8192
    select_warps: int | None = None


# Swept on the H200 at the 8B shape, 32k contexts, budget 2048, batch 1 / 8 / 32, BF16 and FP8 caches (39 shapes,
# scripts/h200_quest_select_sweep.py): 16 programs per SM and two tiles in flight took the selection from
# 16.8 / 36.7 / 100.4 us to 16.1 / 34.3 / 87.1 (BF16) and 19.9 / 29.3 / 73.9 to 16.9 / 28.9 / 68.1 (FP8), the
# best single shape but for 128 pages a tile (0.4% less in total, slower at batch 8).
STREAM_DEFAULT = StreamConfig()


@dataclass(frozen=True)
class AttentionConfig:
    """Launch shape of `sparse_paged_decode`: `keys_per_tile` keys a step (whole pages, at least 16: what a dot
    needs), `num_stages` steps of the key loop in flight (its selection, block-table and K/V loads of later steps
    issued while one is computed; None: Triton's default pipelining), `num_warps` per program, and splits of a
    selection while the launch stays within `programs_per_sm` programs per SM."""

    keys_per_tile: int = 16
    num_stages: int | None = None
    num_warps: int = 4
    programs_per_sm: int = 4


# Swept on the H200 at the 8B shape, 32k contexts, budget 2048, batch 1-32 (scripts/h200_sparse_attention_sweep.py):
# 32 keys a step beat 16 by up to 1.4x at batch 32; FP8 caches want two steps in flight, BF16 Triton's default.
ATTENTION_DEFAULT = AttentionConfig(keys_per_tile=32)
ATTENTION_DEFAULT_FP8 = AttentionConfig(keys_per_tile=32, num_stages=2)


def attention_config(cache_dtype: torch.dtype) -> AttentionConfig:
    """The default launch shape of `sparse_paged_decode` for a cache of `cache_dtype`."""
    return ATTENTION_DEFAULT_FP8 if cache_dtype in FP8_CACHE_DTYPES else ATTENTION_DEFAULT


def key_bounds_shape(num_blocks: int, pages_per_block: int, num_kv_heads: int,
                     head_size: int) -> tuple[int, int, int, int, int]:
    return (num_blocks, pages_per_block, 2, num_kv_heads, head_size)


def key_bounds_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a cache's key bounds: an FP8 cache's own (exact, in stored units), bfloat16 for the others."""
    return cache_dtype if cache_dtype in FP8_CACHE_DTYPES else torch.bfloat16


def bounds_in_cache_units(key_bounds: torch.Tensor) -> bool:
    """True for an FP8 cache's bounds, which hold stored key values (before `k_scale`)."""
    return key_bounds.dtype in FP8_CACHE_DTYPES


def score_scale(key_bounds: torch.Tensor, scale: float, k_scale: float) -> float:
    """The scale the selection gives its bound scores: the attention scale, times `k_scale` for bounds in cache
    units."""
    return scale * k_scale if bounds_in_cache_units(key_bounds) else scale


def _page_size(k_cache_or_block_size: torch.Tensor | int, key_bounds: torch.Tensor) -> int:
    block_size = (k_cache_or_block_size if isinstance(k_cache_or_block_size, int)
                  else k_cache_or_block_size.shape[1])
    pages = key_bounds.shape[1]
    if key_bounds.dim() != 5 or block_size % pages:
        raise ValueError(f"key bounds {tuple(key_bounds.shape)} are not [num_blocks, pages_per_block, 2, "
                         f"num_kv_heads, head_size] with pages_per_block dividing block_size={block_size}")
    return block_size // pages


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ------------------------------------------------------------------------------------------------ key bounds


def _last_writers(slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """True for each token that is the last one this step writes into its block: the next token does not write
    the next slot of the same block. A sequence's tokens are consecutive in the batch and fill consecutive slots."""
    slots = slot_mapping.long()
    following = torch.cat([slots[1:], slots.new_full((1,), -1)])
    continues = (following == slots + 1) & ((slots + 1) % block_size != 0)
    return (slots >= 0) & ~continues


def update_key_bounds_ref(k_cache: torch.Tensor, slot_mapping: torch.Tensor, key_bounds: torch.Tensor,
                          k_scale: float = 1.0) -> None:
    """Recompute the bounds of every block this step wrote (see the module docstring); slot -1 writes nothing."""
    block_size = k_cache.shape[1]
    page_size = _page_size(k_cache, key_bounds)
    slots = slot_mapping.long()[_last_writers(slot_mapping, block_size)]
    if slots.numel() == 0:
        return
    blocks, last_offset = slots // block_size, slots % block_size
    raw = bounds_in_cache_units(key_bounds)
    keys = k_cache[blocks].float() * (1.0 if raw else k_scale)  # [W, block_size, H_kv, D]
    keys = keys.view(len(blocks), block_size // page_size, page_size, *keys.shape[2:])
    filled = torch.arange(block_size, device=slots.device)[None, :] <= last_offset[:, None]
    filled = filled.view(len(blocks), block_size // page_size, page_size, 1, 1)
    lowest = torch.where(filled, keys, float("inf")).amin(dim=2)
    highest = torch.where(filled, keys, float("-inf")).amax(dim=2)
    if raw:  # minima and maxima of stored values are stored values: exact in the cache's dtype
        key_bounds[blocks, :, 0] = lowest.masked_fill(torch.isinf(lowest), 0.0).to(key_bounds.dtype)
        key_bounds[blocks, :, 1] = highest.masked_fill(torch.isinf(highest), 0.0).to(key_bounds.dtype)
    else:
        key_bounds[blocks, :, 0] = stored_bound(lowest, -1.0)
        key_bounds[blocks, :, 1] = stored_bound(highest, 1.0)


def stored_bound(bound: torch.Tensor, direction: float) -> torch.Tensor:
    """The bfloat16 stored for a float32 bound: moved outward (`direction` -1: down, +1: up) by
    `_BOUND_WIDENING` of its magnitude, then truncated to bfloat16 (rounded toward zero); the infinities of empty
    pages stay."""
    moved = torch.where(torch.isinf(bound), bound, bound + direction * bound.abs() * _BOUND_WIDENING)
    truncated = moved.contiguous().view(torch.int32) & -65536  # keep the sign, exponent and top 7 mantissa bits
    return truncated.view(torch.float32).to(torch.bfloat16)


@triton.jit
def _update_key_bounds_kernel(k_ptr, slot_ptr, bounds_ptr, num_tokens, k_scale, stride_kb, stride_kt,
                              stride_bb, WIDENING, BLOCK_SIZE: tl.constexpr, PAGE: tl.constexpr,
                              WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr, RAW: tl.constexpr):
    """One program per written token; only a block's last writer of the step computes, page by page over the
    block's filled slots and every KV head at once (a slot's heads x dims are contiguous: WIDTH of them). RAW:
    bounds in the cache's dtype and units, exact."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    following = tl.load(slot_ptr + t + 1, mask=t + 1 < num_tokens, other=-1)
    continues = (following == slot + 1) & ((slot + 1) % BLOCK_SIZE != 0)
    if (slot < 0) | continues:
        return
    block = slot // BLOCK_SIZE
    last_offset = slot % BLOCK_SIZE
    cols = tl.arange(0, WIDTH_PAD)
    for page in tl.static_range(BLOCK_SIZE // PAGE):
        rows = page * PAGE + tl.arange(0, PAGE)
        ok = (rows[:, None] <= last_offset) & (cols[None, :] < WIDTH)
        keys = tl.load(k_ptr + block * stride_kb + rows[:, None] * stride_kt + cols[None, :], mask=ok, other=0.0)
        keys = keys.to(tl.float32)
        if not RAW:
            keys = keys * k_scale
        lowest = tl.min(tl.where(ok, keys, float("inf")), axis=0)
        highest = tl.max(tl.where(ok, keys, float("-inf")), axis=0)
        base = bounds_ptr + block * stride_bb + page * 2 * WIDTH
        if RAW:
            lowest = tl.where(lowest == float("inf"), 0.0, lowest)
            highest = tl.where(highest == float("-inf"), 0.0, highest)
            tl.store(base + cols, lowest.to(bounds_ptr.dtype.element_ty), mask=cols < WIDTH)
            tl.store(base + WIDTH + cols, highest.to(bounds_ptr.dtype.element_ty), mask=cols < WIDTH)
        else:
            lowest = tl.where(lowest == float("inf"), lowest, lowest - tl.abs(lowest) * WIDENING)
            highest = tl.where(highest == float("-inf"), highest, highest + tl.abs(highest) * WIDENING)
            tl.store(base + cols, lowest.to(tl.bfloat16, fp_downcast_rounding="rtz"), mask=cols < WIDTH)
            tl.store(base + WIDTH + cols, highest.to(tl.bfloat16, fp_downcast_rounding="rtz"), mask=cols < WIDTH)


def update_key_bounds(k_cache: torch.Tensor, slot_mapping: torch.Tensor, key_bounds: torch.Tensor,
                      k_scale: float = 1.0) -> None:
    num_tokens = slot_mapping.shape[0]
    _, block_size, num_kv_heads, head_size = k_cache.shape
    page_size = _page_size(k_cache, key_bounds)
    want = key_bounds_dtype(k_cache.dtype)
    if key_bounds.shape[2:] != (2, num_kv_heads, head_size) or key_bounds.dtype != want:
        raise ValueError(f"key bounds {tuple(key_bounds.shape)} {key_bounds.dtype} do not fit the cache "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}: expected {want} [num_blocks, pages_per_block, 2, "
                         f"{num_kv_heads}, {head_size}]")
    if k_cache.stride(3) != 1 or k_cache.stride(2) != head_size or not key_bounds.is_contiguous():
        raise ValueError("update_key_bounds needs each slot's heads x dims contiguous and contiguous bounds")
    if num_tokens == 0:
        return
    width = num_kv_heads * head_size
    _update_key_bounds_kernel[(num_tokens,)](
        k_cache, slot_mapping, key_bounds, num_tokens, float(k_scale), k_cache.stride(0), k_cache.stride(1),
        key_bounds.stride(0), _BOUND_WIDENING, BLOCK_SIZE=block_size, PAGE=page_size, WIDTH=width,
        WIDTH_PAD=_next_pow2(width), RAW=bounds_in_cache_units(key_bounds))


# ------------------------------------------------------------------------------------------------ selection


def quest_block_scores_ref(q: torch.Tensor, key_bounds: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """Upper bound of the scaled q.k of each of a sequence's pages per KV head, `[S, H_kv, width]` (width: the
    table's blocks x pages per block; float32, float64 for float64 queries), -inf past the sequence's pages."""
    num_seqs, num_heads, head_size = q.shape
    page_size = _page_size(block_size, key_bounds)
    num_kv_heads = key_bounds.shape[3]
    bounds = key_bounds[block_tables.long()].flatten(1, 2)  # [S, width, 2, H_kv, D]
    width = bounds.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    bounds = bounds.to(compute)
    qg = q.to(compute).view(num_seqs, num_kv_heads, num_heads // num_kv_heads, 1, head_size)
    lowest = bounds[:, :, 0].permute(0, 2, 1, 3)[:, :, None]  # [S, H_kv, 1, width, D]
    highest = bounds[:, :, 1].permute(0, 2, 1, 3)[:, :, None]
    scores = torch.maximum(qg * lowest, qg * highest).sum(-1).amax(dim=2) * scale  # [S, H_kv, width]
    num_pages = (seq_lens.long() + page_size - 1) // page_size
    inside = torch.arange(width, device=q.device)[None, :] < num_pages[:, None]
    return scores.masked_fill(~inside[:, None, :], float("-inf"))


@triton.jit
def _quest_scores_kernel(q_ptr, bounds_ptr, bt_ptr, seq_lens_ptr, scores_ptr, width, scale, stride_qs, stride_qh,
                         stride_bb, stride_bt, stride_ss, stride_sh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                         HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, WIDTH_KV: tl.constexpr, PAGE: tl.constexpr,
                         PAGES_PER_BLOCK: tl.constexpr, BLOCK_B: tl.constexpr):
    """Grid (num_seqs, num_kv_heads, cdiv(width, BLOCK_B)): BLOCK_B pages' bounds against the group's queries.
    A page's bounds row holds the minima of every KV head (WIDTH_KV = heads x dims), then the maxima."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_b = tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD
    num_pages = tl.cdiv(tl.load(seq_lens_ptr + seq), PAGE)
    b_ok = (offs_b < width) & (offs_b < num_pages)
    q = tl.load(q_ptr + seq * stride_qs + (kv_head * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g[:, None] < GROUP) & d_ok[None, :], other=0.0).to(tl.float32)
    physical = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + offs_b // PAGES_PER_BLOCK, mask=b_ok,
                       other=0).to(tl.int64)
    page_row = physical * stride_bb + (offs_b % PAGES_PER_BLOCK) * (2 * WIDTH_KV)
    base = bounds_ptr + page_row[:, None] + kv_head * HEAD + offs_d[None, :]
    lowest = tl.load(base, mask=b_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    highest = tl.load(base + WIDTH_KV, mask=b_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    qe = q[:, None, :]
    bound = tl.sum(tl.maximum(qe * lowest[None, :, :], qe * highest[None, :, :]), axis=2)  # [GROUP_PAD, BLOCK_B]
    bound = tl.where(offs_g[:, None] < GROUP, bound, float("-inf"))
    score = tl.where(b_ok, tl.max(bound, axis=0) * scale, float("-inf"))
    tl.store(scores_ptr + seq * stride_ss + kv_head * stride_sh + offs_b, score, mask=offs_b < width)


@triton.jit
def _quest_scores_stream_kernel(q_ptr, bounds_ptr, bt_ptr, seq_lens_ptr, scores_ptr, width, tiles_per_program, scale,
                                stride_qs, stride_qh, stride_bb, stride_bt, stride_ss, stride_sh,
                                GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD: tl.constexpr,
                                HEAD_PAD: tl.constexpr, WIDTH_KV: tl.constexpr, PAGE: tl.constexpr,
                                PAGES_PER_BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, DOT_DTYPE: tl.constexpr,
                                DOT_PREC: tl.constexpr, FILL_TAIL: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Grid (programs per row, num_kv_heads, num_seqs): `tiles_per_program` tiles of BLOCK_B consecutive pages of
    one (sequence, KV head), each scored by two dots of the group's queries split by sign against the pages'
    minima and maxima (exact: their products are exact in fp32 for bf16 operands, fp32 ones use "ieee" dots).
    Without FILL_TAIL a program stops at the sequence's last page (the selection reads no further)."""
    chunk = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    num_pages = tl.minimum(tl.cdiv(tl.load(seq_lens_ptr + seq), PAGE), width)
    end = width if FILL_TAIL else num_pages
    first = chunk * tiles_per_program
    last = tl.minimum(first + tiles_per_program, tl.cdiv(end, BLOCK_B))
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD
    g_ok = offs_g < GROUP
    q = tl.load(q_ptr + seq * stride_qs + (kv_head * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q_pos = tl.maximum(q, 0.0).to(DOT_DTYPE)
    q_neg = tl.minimum(q, 0.0).to(DOT_DTYPE)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    out_row = scores_ptr + seq.to(tl.int64) * stride_ss + kv_head * stride_sh
    for t in tl.range(first, last, num_stages=NUM_STAGES):
        offs_b = t * BLOCK_B + tl.arange(0, BLOCK_B)
        b_ok = offs_b < num_pages
        physical = tl.load(bt_row + offs_b // PAGES_PER_BLOCK, mask=b_ok, other=0).to(tl.int64)
        page_row = physical * stride_bb + (offs_b % PAGES_PER_BLOCK) * (2 * WIDTH_KV)
        # loaded as [dims, pages], the dots' B operand as it is (no transpose), so the loads pipeline
        base = bounds_ptr + page_row[None, :] + kv_head * HEAD + offs_d[:, None]
        if HEAD == HEAD_PAD:  # no mask along the contiguous dims: vector loads, which pipeline
            ok = b_ok[None, :]
        else:
            ok = d_ok[:, None] & b_ok[None, :]
        lowest = tl.load(base, mask=ok, other=0.0).to(DOT_DTYPE)
        highest = tl.load(base + WIDTH_KV, mask=ok, other=0.0).to(DOT_DTYPE)
        bound = tl.dot(q_neg, lowest, out_dtype=tl.float32, input_precision=DOT_PREC)
        bound = tl.dot(q_pos, highest, acc=bound, out_dtype=tl.float32, input_precision=DOT_PREC)
        bound = tl.where(g_ok[:, None], bound, float("-inf"))
        score = tl.where(b_ok, tl.max(bound, axis=0) * scale, float("-inf"))
        tl.store(out_row + offs_b, score, mask=offs_b < width)


def _stream_scores(q: torch.Tensor, key_bounds: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   scale: float, page_size: int, fill_tail: bool, config: StreamConfig) -> torch.Tensor:
    num_seqs, num_heads, head_size = q.shape
    pages_per_block, num_kv_heads = key_bounds.shape[1], key_bounds.shape[3]
    width = block_tables.shape[1] * pages_per_block
    scores = torch.empty(num_seqs, num_kv_heads, width, dtype=torch.float32, device=q.device)
    if num_seqs == 0 or width == 0:
        return scores
    group = num_heads // num_kv_heads
    # bf16 queries dot bf16 bounds exactly; other dtypes (and the interpreter, whose bf16 dots are wrong) in fp32
    bf16 = q.is_cuda and q.dtype == torch.bfloat16
    tiles = triton.cdiv(width, config.block_b)
    rows = num_seqs * num_kv_heads
    per_row = max(1, min(tiles, -(-config.programs_per_sm * common.num_sms(q.device, off_cuda=16) // rows)))
    tiles_per_program = -(-tiles // per_row)
    _quest_scores_stream_kernel[(triton.cdiv(tiles, tiles_per_program), num_kv_heads, num_seqs)](
        q, key_bounds, block_tables, seq_lens, scores, width, tiles_per_program, float(scale), q.stride(0),
        q.stride(1), key_bounds.stride(0), block_tables.stride(0), scores.stride(0), scores.stride(1),
        GROUP=group, BLOCK_G=max(16, _next_pow2(group)), HEAD=head_size, HEAD_PAD=max(16, _next_pow2(head_size)),
        WIDTH_KV=num_kv_heads * head_size, PAGE=page_size, PAGES_PER_BLOCK=pages_per_block,
        BLOCK_B=config.block_b, DOT_DTYPE=tl.bfloat16 if bf16 else tl.float32,
        DOT_PREC="tf32" if bf16 else "ieee", FILL_TAIL=fill_tail, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps if bf16 else max(8, config.num_warps))  # fp32 tiles spill at 4 warps
    return scores


def quest_block_scores(q: torch.Tensor, key_bounds: torch.Tensor, seq_lens: torch.Tensor,
                       block_tables: torch.Tensor, scale: float, block_size: int, *, impl: str = "stream",
                       config: StreamConfig = STREAM_DEFAULT) -> torch.Tensor:
    """Triton `quest_block_scores_ref`: "stream" (many pages a program, tensor-core dots) or "topk" (the earlier
    kernel: 16 pages a program)."""
    _check_impl(impl)
    if impl == "stream":
        if not key_bounds.is_contiguous() or q.stride(-1) != 1 or block_tables.stride(-1) != 1:
            raise ValueError("quest_block_scores needs contiguous key bounds and a contiguous last dimension of q "
                             "and block_tables")
        return _stream_scores(q, key_bounds, seq_lens, block_tables, scale, _page_size(block_size, key_bounds),
                              True, config)
    num_seqs, num_heads, head_size = q.shape
    page_size = _page_size(block_size, key_bounds)
    pages_per_block, num_kv_heads = key_bounds.shape[1], key_bounds.shape[3]
    width = block_tables.shape[1] * pages_per_block
    if not key_bounds.is_contiguous() or q.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("quest_block_scores needs contiguous key bounds and a contiguous last dimension of q and "
                         "block_tables")
    scores = torch.empty(num_seqs, num_kv_heads, width, dtype=torch.float32, device=q.device)
    if num_seqs == 0 or width == 0:
        return scores
    group = num_heads // num_kv_heads
    block_b = 16
    _quest_scores_kernel[(num_seqs, num_kv_heads, triton.cdiv(width, block_b))](
        q, key_bounds, block_tables, seq_lens, scores, width, float(scale), q.stride(0), q.stride(1),
        key_bounds.stride(0), block_tables.stride(0), scores.stride(0), scores.stride(1),
        GROUP=group, GROUP_PAD=max(2, _next_pow2(group)), HEAD=head_size, HEAD_PAD=max(16, _next_pow2(head_size)),
        WIDTH_KV=num_kv_heads * head_size, PAGE=page_size, PAGES_PER_BLOCK=pages_per_block, BLOCK_B=block_b)
    return scores


def select_pages(scores: torch.Tensor, seq_lens: torch.Tensor, page_size: int, num_selected: int,
                 sink_pages: int, recent_pages: int, *, stable_ties: bool = True) -> torch.Tensor:
    """The selected logical pages `[S, H_kv, num_selected]` int32 from page scores `[S, H_kv, width]`: the first
    `sink_pages`, the `num_selected - sink_pages - recent_pages` best-scored pages between them and the recent
    ones (-inf scores never; equal scores: the lower page first, or torch.topk's order without `stable_ties`),
    and the last `recent_pages` (the page being written is the last); ascending, -1 in unused slots. Static
    shapes (over the table width), no host sync."""
    num_seqs, num_kv_heads, width = scores.shape
    device = scores.device
    num_pages = ((seq_lens.long() + page_size - 1) // page_size)[:, None, None]  # [S, 1, 1]
    positions = torch.arange(width, device=device)
    between = (positions >= sink_pages) & (positions < num_pages - recent_pages)  # [S, 1, width]
    candidates = scores.masked_fill(~between, float("-inf"))
    num_chosen = num_selected - sink_pages - recent_pages
    take = min(num_chosen, width)
    if stable_ties:
        values, order = candidates.sort(dim=-1, descending=True, stable=True)
        values, chosen = values[..., :take], order[..., :take]
    else:
        values, chosen = candidates.topk(take, dim=-1)
    chosen = torch.where(values > float("-inf"), chosen, -1)
    if take < num_chosen:
        chosen = torch.cat([chosen, chosen.new_full((num_seqs, num_kv_heads, num_chosen - take), -1)], dim=-1)
    sinks = torch.arange(sink_pages, device=device).expand(num_seqs, num_kv_heads, sink_pages)
    sinks = torch.where(sinks < num_pages, sinks, -1)
    recent = num_pages - recent_pages + torch.arange(recent_pages, device=device)  # [S, 1, recent]
    recent = torch.where(recent >= sink_pages, recent, -1).expand(num_seqs, num_kv_heads, recent_pages)
    selected = torch.cat([sinks, chosen, recent], dim=-1)
    unused = selected < 0
    ordered = selected.masked_fill(unused, width + num_selected).sort(dim=-1).values
    return ordered.masked_fill(ordered >= width + num_selected, -1).to(torch.int32)


def quest_select_ref(q: torch.Tensor, key_bounds: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                     scale: float, block_size: int, num_selected: int, sink_blocks: int,
                     recent_blocks: int, *, impl: str = "stream",
                     config: StreamConfig = STREAM_DEFAULT) -> torch.Tensor:
    """q `[S, H, D]` (one decode token per sequence) -> selected logical pages `[S, H_kv, num_selected]`; the
    sinks and recent tokens are counted in blocks and kept as the pages that hold them. Ties: the lower page
    (`impl` and `config` name the Triton path and are not used here)."""
    _check_impl(impl)
    scores = quest_block_scores_ref(q, key_bounds, seq_lens, block_tables, scale, block_size)
    pages = key_bounds.shape[1]
    return select_pages(scores, seq_lens, block_size // pages, num_selected, sink_blocks * pages,
                        recent_blocks * pages)


def quest_select(q: torch.Tensor, key_bounds: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                 scale: float, block_size: int, num_selected: int, sink_blocks: int,
                 recent_blocks: int, *, impl: str = "stream", config: StreamConfig = STREAM_DEFAULT) -> torch.Tensor:
    """Triton `quest_select_ref`. "stream": two Triton launches (streamed scores up to each sequence's last page,
    then `select_pages_triton`); "topk": the earlier scores kernel, then torch's top-k and sort (static width)."""
    _check_impl(impl)
    pages = key_bounds.shape[1]
    page_size = block_size // pages
    if impl == "topk":
        scores = quest_block_scores(q, key_bounds, seq_lens, block_tables, scale, block_size, impl="topk")
        return select_pages(scores, seq_lens, page_size, num_selected, sink_blocks * pages, recent_blocks * pages,
                            stable_ties=False)
    _page_size(block_size, key_bounds)
    if not key_bounds.is_contiguous() or q.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("quest_select needs contiguous key bounds and a contiguous last dimension of q and "
                         "block_tables")
    scores = _stream_scores(q, key_bounds, seq_lens, block_tables, scale, page_size, False, config)
    return select_pages_triton(scores, seq_lens, page_size, num_selected, sink_blocks * pages,
                               recent_blocks * pages, config=config)


def _check_impl(impl: str) -> None:
    if impl not in SELECT_IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {SELECT_IMPLS}")


@triton.jit
def _ordered_key(x):
    """int32 keys ordered as the float32 scores are (-0.0 as +0.0, as torch compares them): negative floats get
    their magnitude bits flipped."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x == 0.0, 0, bits)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _digit_counts(x, ok, prefix, sign, SHIFT: tl.constexpr, FIRST: tl.constexpr):
    """Per 4-bit digit at SHIFT, the candidates (`ok`, score above -inf) whose higher digits are `prefix`'s."""
    ok = ok & (x > float("-inf"))
    ukey = _ordered_key(x) ^ sign
    if not FIRST:
        ok = ok & ((ukey >> (SHIFT + 4)) == (prefix >> (SHIFT + 4)))
    return tl.histogram((ukey >> SHIFT) & 15, 16, mask=ok)


@triton.jit
def _select_pages_kernel(scores_ptr, seq_lens_ptr, out_ptr, width, num_selected, stride_ss, stride_sh, stride_os,
                         stride_oh, PAGE: tl.constexpr, SINKS: tl.constexpr, RECENT: tl.constexpr,
                         TAKE: tl.constexpr, CHUNK: tl.constexpr, SINGLE: tl.constexpr):
    """Grid (num_kv_heads, num_seqs). Candidates are the pages in [SINKS, num_pages - RECENT) with a score above
    -inf. A radix select over their keys, 4 bits a pass from the top (a 16-bin histogram per pass), finds the
    TAKE-th largest key T and how many keys equal to T to take; it stops early once the digit's bin is taken
    whole. One ordered pass then writes sinks, the candidates above T, the first ones equal to T (lower pages
    first) and the recent pages at their ascending positions (prefix sums), and -1 after them. SINGLE (the row
    fits one CHUNK): the row is loaded once and every pass works on registers."""
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    num_pages = tl.minimum(tl.cdiv(tl.load(seq_lens_ptr + seq), PAGE), width)
    lo = SINKS
    hi = num_pages - RECENT
    row = scores_ptr + seq.to(tl.int64) * stride_ss + kv_head * stride_sh
    out_row = out_ptr + seq.to(tl.int64) * stride_os + kv_head * stride_oh
    bins = tl.arange(0, 16)
    lanes = tl.arange(0, CHUNK)
    sign = tl.full([], -2147483648, tl.int32)  # flips signed-order keys to unsigned order and back
    if SINGLE:
        row_ok = (lanes >= lo) & (lanes < hi)
        row_x = tl.load(row + lanes, mask=row_ok, other=float("-inf"))
    prefix = tl.zeros([], tl.int32)  # high digits found so far, on keys in unsigned order
    remaining = tl.zeros([], tl.int32) + TAKE
    need = tl.full([], 2147483647, tl.int32)  # keys equal to T still to take (all, after an early stop)
    done = tl.zeros([], tl.int32)
    for p in tl.static_range(8):
        SHIFT = 28 - 4 * p
        if done == 0:
            if SINGLE:
                counts = _digit_counts(row_x, row_ok, prefix, sign, SHIFT, p == 0)
            else:
                counts = tl.zeros([16], tl.int32)
                for start in range(lo, hi, CHUNK):
                    offs = start + lanes
                    ok = offs < hi
                    x = tl.load(row + offs, mask=ok, other=float("-inf"))
                    counts += _digit_counts(x, ok, prefix, sign, SHIFT, p == 0)
            # candidates whose digit is >= each bin
            at_least = tl.sum(tl.where(bins[None, :] >= bins[:, None], counts[None, :], 0), axis=1)
            if p == 0:
                remaining = tl.minimum(remaining, tl.sum(counts))
            b = tl.max(tl.where(at_least >= remaining, bins, 0))
            above = tl.sum(tl.where(bins > b, counts, 0))
            in_bin = tl.sum(tl.where(bins == b, counts, 0))
            remaining -= above
            prefix = prefix | (b << SHIFT)
            if in_bin == remaining:
                done = done + 1
            elif p == 7:
                need = remaining
    threshold = prefix ^ sign  # back to the signed order of _ordered_key
    written = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for start in range(0, num_pages, CHUNK):
        offs = start + lanes
        inside = offs < num_pages
        middle = inside & (offs >= lo) & (offs < hi)
        if SINGLE:
            x = row_x
        else:
            x = tl.load(row + offs, mask=middle, other=float("-inf"))
        middle = middle & (x > float("-inf"))
        key = _ordered_key(x)
        tie = middle & (key == threshold)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        picked = (middle & (key > threshold)) | (tie & (tie_rank < need))
        picked = picked | (inside & ((offs < SINKS) | (offs >= hi)))
        position = written + tl.cumsum(picked.to(tl.int32), axis=0) - 1
        tl.store(out_row + position, offs, mask=picked)
        written += tl.sum(picked.to(tl.int32))
        ties += tl.sum(tie.to(tl.int32))
    for start in range(0, num_selected, CHUNK):
        offs = start + lanes
        tl.store(out_row + offs, tl.full([CHUNK], -1, tl.int32), mask=(offs >= written) & (offs < num_selected))


def select_pages_triton(scores: torch.Tensor, seq_lens: torch.Tensor, page_size: int, num_selected: int,
                        sink_pages: int, recent_pages: int, *, config: StreamConfig = STREAM_DEFAULT) -> torch.Tensor:
    """Triton `select_pages` (ties: the lower page first; NaN scores are never chosen). One program per (sequence,
    KV head); the page count must fit the scores' width (`seq_len <= width * page_size`)."""
    num_seqs, num_kv_heads, width = scores.shape
    num_chosen = num_selected - sink_pages - recent_pages
    if num_chosen < 0 or sink_pages < 0 or recent_pages < 0:
        raise ValueError(f"num_selected={num_selected} must cover sink_pages={sink_pages} + "
                         f"recent_pages={recent_pages}")
    if scores.stride(-1) != 1:
        raise ValueError("select_pages_triton needs scores with a contiguous last dimension")
    out = torch.empty(num_seqs, num_kv_heads, num_selected, dtype=torch.int32, device=scores.device)
    if num_seqs == 0 or num_selected == 0:
        return out
    chunk = min(config.select_chunk, max(16, _next_pow2(width)))
    _select_pages_kernel[(num_kv_heads, num_seqs)](
        scores, seq_lens, out, width, num_selected, scores.stride(0), scores.stride(1), out.stride(0),
        out.stride(1), PAGE=page_size, SINKS=sink_pages, RECENT=recent_pages, TAKE=num_chosen,
        CHUNK=chunk, SINGLE=width <= chunk, num_warps=config.select_warps or min(16, max(4, chunk // 512)))
    return out


# ------------------------------------------------------------------------------------------------ attention


def sparse_paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                            block_tables: torch.Tensor, selected: torch.Tensor, scale: float, k_scale: float = 1.0,
                            v_scale: float = 1.0, out: torch.Tensor | None = None, *,
                            page_size: int | None = None, num_splits: int | None = None,
                            merge: str = "triton") -> torch.Tensor:
    """q `[S, H, D]`, one query token per sequence at position seq_len - 1, attending to the keys of its KV head's
    selected logical pages (`selected[s, h]`, -1 unused; pages of `page_size` tokens, default the block size)
    below seq_len. Float32 math (float64 for float64 q); `num_splits` and `merge` shape the Triton launch only."""
    num_seqs, num_heads, head_size = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    page_size = _check_page_size(page_size, block_size)
    group = num_heads // num_kv_heads
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    used = selected >= 0
    logical = selected.long().clamp_min(0)  # [S, H_kv, K]
    token = logical[..., None] * page_size + torch.arange(page_size, device=q.device)  # [S, H_kv, K, page]
    physical = block_tables.long().gather(1, (token // block_size).view(num_seqs, -1)).view_as(token)
    heads = torch.arange(num_kv_heads, device=q.device)[None, :, None, None]
    keys = k_cache[physical, token % block_size, heads].to(compute) * k_scale  # [S, H_kv, K, page, D]
    values = v_cache[physical, token % block_size, heads].to(compute) * v_scale
    visible = used[..., None] & (token < seq_lens.long()[:, None, None, None])
    values = values.masked_fill(~visible[..., None], 0.0)  # unwritten slots may hold NaN; 0 * NaN is NaN
    qg = q.to(compute).view(num_seqs, num_kv_heads, group, head_size)
    scores = torch.einsum("shgd,shktd->shgkt", qg, keys) * scale
    scores = scores.masked_fill(~visible[:, :, None], float("-inf")).flatten(3)  # [S, H_kv, G, K * block]
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a sequence with nothing visible gives zeros
    result = torch.einsum("shgn,shnd->shgd", probs, values.flatten(2, 3))
    out.copy_(result.reshape(num_seqs, num_heads, head_size).to(out.dtype))
    return out


@triton.jit
def _sparse_decode_kernel(q_ptr, k_ptr, v_ptr, seq_lens_ptr, bt_ptr, sel_ptr, out_ptr, po_ptr, plse_ptr, num_selected,
                          qk_scale, v_scale, stride_qs, stride_qh, stride_os, stride_oh, stride_kb, stride_kt,
                          stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, stride_ss, stride_sh,
                          GROUP: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, PAGE: tl.constexpr, PAGES_PER_TILE: tl.constexpr,
                          DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, Q_CLAMP: tl.constexpr,
                          SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Grid (num_seqs, num_kv_heads, num_splits). Rows of the tile are the group's query heads; a key tile is
    PAGES_PER_TILE consecutive selected pages (PAGE keys each: at least 16 keys a tile, what a dot needs), online
    softmax in the log2 domain. With SPLIT, each program covers a slice of the tiles and writes a normalized
    partial and its log-sum-exp."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, PAGE * PAGES_PER_TILE)
    entry_of_key = offs_n // PAGE
    within_page = offs_n % PAGE
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD
    row_ok = offs_m < GROUP
    head = kv_head * GROUP + offs_m
    seq_len = tl.load(seq_lens_ptr + seq)
    q = tl.load(q_ptr + seq * stride_qs + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if Q_CLAMP:  # bf16 queries into fp16 dots (FP8 cache): keep them finite
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0)
    q = q.to(DOT_DTYPE)
    num_tiles = tl.cdiv(num_selected, PAGES_PER_TILE)
    per_split = tl.cdiv(num_tiles, tl.num_programs(2))
    first = split * per_split
    last = tl.minimum(first + per_split, num_tiles)
    sel_row = sel_ptr + seq.to(tl.int64) * stride_ss + kv_head * stride_sh
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for j in tl.range(first, last, num_stages=NUM_STAGES):
        entry = j * PAGES_PER_TILE + entry_of_key
        logical = tl.load(sel_row + entry, mask=entry < num_selected, other=-1)
        token = tl.maximum(logical, 0) * PAGE + within_page
        key_ok = (logical >= 0) & (token < seq_len)
        physical = tl.load(bt_row + token // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        key_row = physical * stride_kb + (token % BLOCK_SIZE) * stride_kt
        value_row = physical * stride_vb + (token % BLOCK_SIZE) * stride_vt
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + key_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), out_dtype=tl.float32, input_precision=DOT_PREC) * qk_scale
        qk = tl.where(key_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + value_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), out_dtype=tl.float32,
                                             input_precision=DOT_PREC)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc * (v_scale / l_safe)[:, None]
    if SPLIT:
        row = ((split * tl.num_programs(0) + seq) * tl.num_programs(1) + kv_head).to(tl.int64) * BLOCK_M + offs_m
        tl.store(plse_ptr + row, tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe)))
        tl.store(po_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], o)
    else:
        tl.store(out_ptr + seq * stride_os + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def sparse_decode_splits(num_seqs: int, num_kv_heads: int, num_tiles: int, device: torch.device,
                         programs_per_sm: int = 4) -> int:
    """Splits of each (sequence, KV head)'s selection: double while the launch stays within `programs_per_sm`
    programs per SM (4: the dense decode's BF16 rule), keeping >= 4 key tiles per split. From shapes only."""
    sms = common.num_sms(device, off_cuda=16)
    splits = 1
    while num_seqs * num_kv_heads * splits * 2 <= programs_per_sm * sms and splits * 2 * 4 <= num_tiles:
        splits *= 2
    return splits


def _check_page_size(page_size: int | None, block_size: int) -> int:
    if page_size is None:
        return block_size
    if page_size < 1 or block_size % page_size or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a power of two dividing block_size={block_size}")
    return page_size


def sparse_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, selected: torch.Tensor, scale: float, k_scale: float = 1.0,
                        v_scale: float = 1.0, out: torch.Tensor | None = None, *, page_size: int | None = None,
                        num_splits: int | None = None, merge: str = "triton",
                        config: AttentionConfig | None = None) -> torch.Tensor:
    """Triton `sparse_paged_decode_ref`; `num_splits` overrides the shape rule (tests); `merge` combines the
    splits in one Triton launch ("triton") or in torch ops ("torch", the earlier path); `config` the launch
    shape (None: `attention_config` of the cache's dtype)."""
    if merge not in MERGE_IMPLS:
        raise ValueError(f"merge={merge!r}: expected one of {MERGE_IMPLS}")
    num_seqs, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, kv_head_size = k_cache.shape
    page_size = _check_page_size(page_size, block_size)
    if num_heads % num_kv_heads or kv_head_size != head_size or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if selected.shape[:2] != (num_seqs, num_kv_heads):
        raise ValueError(f"selected blocks {tuple(selected.shape)} are not [num_seqs={num_seqs}, "
                         f"num_kv_heads={num_kv_heads}, num_selected]")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or selected.stride(-1) != 1:
        raise ValueError("q, the caches and the selection must have a contiguous last dimension")
    if out is None:
        out = torch.empty_like(q)
    num_selected = selected.shape[2]
    if num_seqs == 0 or num_selected == 0:
        return out.zero_()
    group = num_heads // num_kv_heads
    head_pad = max(16, _next_pow2(head_size))
    block_m = max(16, _next_pow2(group))
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    # Off the GPU the interpreter's bf16 dots are wrong, so they run in fp32 there; an FP8 cache dots in fp16.
    if not q.is_cuda or q.dtype not in _DOT_DTYPES:
        dot_dtype = tl.float32
    else:
        dot_dtype = tl.float16 if fp8 else _DOT_DTYPES[q.dtype]
    config = config or attention_config(k_cache.dtype)
    pages_per_tile = max(1, max(16, config.keys_per_tile) // page_size)
    num_tiles = -(-num_selected // pages_per_tile)
    splits = num_splits or sparse_decode_splits(num_seqs, num_kv_heads, num_tiles, q.device, config.programs_per_sm)
    if splits > 1:
        partial = torch.empty(splits, num_seqs, num_kv_heads, block_m, head_pad, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, num_seqs, num_kv_heads, block_m, dtype=torch.float32, device=q.device)
    else:
        partial = lse = out
    _sparse_decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, seq_lens, block_tables, selected, out, partial, lse, num_selected,
        float(scale) * float(k_scale) * _LOG2E, float(v_scale), q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0), selected.stride(0), selected.stride(1),
        GROUP=group, HEAD=head_size, HEAD_PAD=head_pad, BLOCK_M=block_m, BLOCK_SIZE=block_size, PAGE=page_size,
        PAGES_PER_TILE=pages_per_tile, DOT_DTYPE=dot_dtype, DOT_PREC="ieee" if dot_dtype == tl.float32 else "tf32",
        Q_CLAMP=fp8 and q.dtype == torch.bfloat16, SPLIT=splits > 1, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps)
    if splits > 1:
        (_merge_partials_triton if merge == "triton" else _merge_partials)(partial, lse, out, group, head_size)
    return out


def _merge_partials(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, group: int, head_size: int) -> None:
    """Combine the splits' normalized partials by their log2-sum-exp weights (empty splits weigh nothing)."""
    top = lse.amax(dim=0)
    weight = torch.exp2(lse - torch.where(top == float("-inf"), 0.0, top))  # [splits, S, H_kv, BLOCK_M]
    total = weight.sum(dim=0)
    merged = (weight[..., None] * partial).sum(dim=0) / torch.where(total == 0.0, 1.0, total)[..., None]
    num_seqs, num_kv_heads = merged.shape[:2]
    out.copy_(merged[:, :, :group, :head_size].reshape(num_seqs, num_kv_heads * group, head_size).to(out.dtype))


@triton.jit
def _merge_partials_kernel(out_ptr, po_ptr, plse_ptr, num_splits, stride_os, stride_oh, GROUP: tl.constexpr,
                           HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                           SPLITS_PAD: tl.constexpr):
    """Grid (num_seqs, num_kv_heads, GROUP): one query head's partials of every split in one tile."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    r = tl.program_id(2)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_ok = offs_s < num_splits
    row = ((offs_s * tl.num_programs(0) + seq) * tl.num_programs(1) + kv_head).to(tl.int64) * BLOCK_M + r
    merged = common.merge_splits(plse_ptr, po_ptr, row, s_ok, offs_d, HEAD_PAD)
    tl.store(out_ptr + seq * stride_os + (kv_head * GROUP + r) * stride_oh + offs_d,
             merged.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD)


def _merge_partials_triton(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, group: int,
                           head_size: int) -> None:
    """Triton `_merge_partials`: one launch instead of a chain of torch ops."""
    splits, num_seqs, num_kv_heads, block_m, head_pad = partial.shape
    _merge_partials_kernel[(num_seqs, num_kv_heads, group)](
        out, partial, lse, splits, out.stride(0), out.stride(1), GROUP=group, HEAD=head_size, HEAD_PAD=head_pad,
        BLOCK_M=block_m, SPLITS_PAD=max(2, _next_pow2(splits)), num_warps=4)
