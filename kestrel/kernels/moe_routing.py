"""Mixture-of-experts routing in two launches for decode-sized steps: the router's softmax top-k, and the
alignment of the (token, slot) pairs by expert that the fused MoE GEMMs read (`fused_moe.moe_align`'s layout).

The torch versions take about twenty small launches per layer (softmax, top-k, renormalisation; a sort, two
binary searches, cumulative sums, a scatter), which at batch 1 cost more than reading the chosen experts' weights.

- `route_topk`: one program per token; the scores in fp32 over the padded expert row (the softmax, or each
  logit's sigmoid: `scoring`), then `top_k` rounds of arg-max (the lowest index wins a tie), the weights
  renormalised to sum to 1 when asked. Weights fp32 `[T, k]`, ids int64 `[T, k]` in descending weight order, as
  `torch.topk` gives them. Grouped top-k (the experts in `num_groups` groups, each token choosing among those of
  its `topk_groups` best groups, a group scored by its best expert) runs in `route_topk_ref`.
- `moe_align_single`: one program for the whole step, every pair in its registers. Per-expert counts by a
  histogram, each expert's run padded to a multiple of BLOCK_M, their starts by a cumulative sum; the pairs sorted
  by (expert, pair) in registers, so the i-th goes to its expert's start plus its rank among that expert's pairs
  and the order within an expert is the pairs' order, as the stable torch sort gives it. It serves steps of at
  most `ALIGN_SINGLE_MAX_PAIRS` pairs; larger ones take the torch sort. (It replaced one-hot counts and pairwise
  ranks over chunks of 64 pairs in sequence, which took about 40 us of one SM at 1,024 pairs and 128 experts.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels import common

# The single-program alignment holds every pair in one program's registers; larger steps take the torch sort.
# It runs any count, but its one program pays for the sort of every pair (H100, Qwen3-30B-A3B's 128 experts x top-8,
# `scripts/h200_moe_op_profile.py --align-max-pairs 4096`): 2,048 pairs 20.4 us against about 52 us of the torch
# path's launches; 4,096 pairs 77 us against about 55 us.
ALIGN_SINGLE_MAX_PAIRS = 2048
# The block owners' comparisons hold FILL x E_PAD values; this bounds them (registers of one program).
_ONE_HOT_ELEMENTS = 8192
_SLOTS_FILL = 1024  # sentinel slots written per store


# ------------------------------------------------------------------------------------------------ router


SCORINGS = ("softmax", "sigmoid")


def check_routing(num_experts: int, top_k: int, scoring: str, num_groups: int, topk_groups: int) -> None:
    """ValueError naming what a router of `num_experts` experts cannot do."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring={scoring!r}: a router scores its experts by one of {list(SCORINGS)}")
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the {num_experts} experts")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups={topk_groups} must be in 1..num_groups={num_groups}")
    choosable = topk_groups * (num_experts // num_groups)
    if not 0 < top_k <= choosable:
        among = ("the router's experts" if num_groups == 1 else
                 f"the experts of {topk_groups} of {num_groups} groups of the router's {num_experts}")
        raise ValueError(f"top_k={top_k} must be in 1..{choosable} ({among})")


def route_topk_ref(logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax",
                   num_groups: int = 1, topk_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int64 [T, k]) of each token's `top_k` experts by score: the softmax of
    the logits, or each one's sigmoid. With `num_groups` > 1 the experts form that many equal groups in order, and
    a token chooses among the experts of its `topk_groups` groups of highest best score (DeepSeek's grouped top-k)."""
    num_tokens, num_experts = logits.shape
    check_routing(num_experts, top_k, scoring, num_groups, topk_groups)
    probs = F.softmax(logits.float(), dim=-1) if scoring == "softmax" else torch.sigmoid(logits.float())
    candidates = probs
    if num_groups > 1:
        per_group = num_experts // num_groups
        best_of_group = probs.view(num_tokens, num_groups, per_group).amax(dim=-1)
        groups = torch.topk(best_of_group, topk_groups, dim=-1).indices
        kept = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=logits.device)
        kept.scatter_(1, groups, True)
        # Experts outside the kept groups can never be chosen: below any score (scores are >= 0).
        candidates = probs.masked_fill(~kept.repeat_interleave(per_group, dim=1), -1.0)
    # A stable sort: among equal scores the lowest index first, as the kernel picks them (torch.topk does not say).
    ids = torch.sort(candidates, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@triton.jit
def topk_of_row(logits, offs, valid, weights_ptr, ids_ptr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, SIGMOID: tl.constexpr = False):
    """One token's top-k by softmax probability (SIGMOID: by each logit's sigmoid) from its fp32 `logits` over
    `offs` (E_PAD lanes, `valid` the real experts, -inf elsewhere), stored at `weights_ptr` / `ids_ptr` (TOP_K
    each). Shared by the routing launch and the router GEMV that routes in its last program (`gemv.gemv_route`)."""
    if SIGMOID:
        probs = tl.where(valid, 1.0 / (1.0 + tl.exp(-logits)), 0.0)
    else:
        exps = tl.where(valid, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
        probs = exps / tl.sum(exps, axis=0)
    # Probabilities are >= 0: -1 marks what is taken or padding. A NaN (a NaN logit, or stale memory) counts as
    # 0, so every pick is a real expert: an id past the experts would make the alignment index out of bounds.
    remaining = tl.where(valid, tl.where(probs == probs, probs, 0.0), -1.0)
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        chosen = tl.min(tl.where(remaining == best, offs, E_PAD), axis=0)
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, chosen.to(tl.int64), ids)
        remaining = tl.where(offs == chosen, -1.0, remaining)
    if RENORMALIZE:
        weights = weights / tl.sum(tl.where(slots < TOP_K, weights, 0.0), axis=0)
    tl.store(weights_ptr + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + slots, ids, mask=slots < TOP_K)


@triton.jit
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, TOP_K: tl.constexpr,
                       K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, SIGMOID: tl.constexpr,
                       USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0)
    offs = tl.arange(0, E_PAD)
    valid = offs < num_experts
    logits = tl.load(logits_ptr + token * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    topk_of_row(logits, offs, valid, weights_ptr + token * TOP_K, ids_ptr + token * TOP_K, TOP_K, K_PAD, E_PAD,
                RENORMALIZE, SIGMOID)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax",
               num_groups: int = 1, topk_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `route_topk_ref`: one launch; grouped top-k (`num_groups` > 1) runs the reference's torch ops."""
    num_tokens, num_experts = logits.shape
    check_routing(num_experts, top_k, scoring, num_groups, topk_groups)
    if num_groups > 1:
        return route_topk_ref(logits, top_k, renormalize, scoring, num_groups, topk_groups)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens:
        e_pad = triton.next_power_of_2(num_experts)
        _route_topk_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                          K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad,
                                          RENORMALIZE=renormalize, SIGMOID=scoring == "sigmoid",
                                          num_warps=4 if e_pad >= 512 else 1,
                                          **common.pdl_options(logits, "pdl_decode"))
    return weights, ids


# ------------------------------------------------------------------------------------------------ alignment


@triton.jit
def _align_single_kernel(ids_ptr, num_pairs, sorted_ptr, expert_ids_ptr, num_padded_ptr, shift_ptr, num_blocks,
                         num_experts, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, PAIRS_PAD: tl.constexpr,
                         FILL: tl.constexpr, SLOTS_FILL: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    experts = tl.arange(0, E_PAD)
    rows = tl.arange(0, PAIRS_PAD)
    ids = tl.load(ids_ptr + rows, mask=rows < num_pairs, other=-1).to(tl.int32)
    kept = ids >= 0  # pairs of expert -1 (another rank's) land nowhere
    counts = tl.histogram(tl.where(kept, ids, 0), E_PAD, mask=kept)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    # The kept pairs sorted by (expert, pair) put an expert's pairs at places firsts[e] .. firsts[e] + counts[e] - 1
    # in pair order; place i goes to slot starts[e] + (i - firsts[e]).
    firsts = tl.cumsum(counts, axis=0) - counts
    tl.store(shift_ptr + experts, starts - firsts)
    # A block's expert: how many experts' padded runs end at or before its first row (the last one for blocks
    # past the real total).
    ends_of_real = tl.where(experts < num_experts, ends, 2147483647)
    for first in range(0, num_blocks, FILL):
        blocks = first + tl.arange(0, FILL)
        owner = tl.sum((ends_of_real[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blocks, tl.minimum(owner, num_experts - 1), mask=blocks < num_blocks)
    for first in range(0, num_blocks * BLOCK_M, SLOTS_FILL):
        slots = first + tl.arange(0, SLOTS_FILL)
        tl.store(sorted_ptr + slots, tl.zeros([SLOTS_FILL], dtype=tl.int32) + num_pairs,
                 mask=slots < num_blocks * BLOCK_M)
    keys = tl.sort(tl.where(kept, ids * PAIRS_PAD + rows, E_PAD * PAIRS_PAD + rows))
    expert = keys // PAIRS_PAD
    placed = expert < E_PAD
    tl.debug_barrier()  # the sentinels and the shifts land before any pair reads or overwrites them
    shift = tl.load(shift_ptr + expert, mask=placed, other=0)
    tl.store(sorted_ptr + shift + rows, keys % PAIRS_PAD, mask=placed)


def moe_align_single(topk_ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fused_moe.moe_align` in one launch (same outputs, same shapes); for at most `ALIGN_SINGLE_MAX_PAIRS`
    pairs (every pair sits in one program's registers, padded to a power of two)."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    num_blocks = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=flat.device)
    e_pad = triton.next_power_of_2(num_experts)
    shift = torch.empty(e_pad, dtype=torch.int32, device=flat.device)
    pairs_pad = max(16, triton.next_power_of_2(n))
    _align_single_kernel[(1,)](flat, n, sorted_ids, expert_ids, num_padded, shift, num_blocks, num_experts,
                               BLOCK_M=block_m, E_PAD=e_pad, PAIRS_PAD=pairs_pad,
                               FILL=max(16, _ONE_HOT_ELEMENTS // e_pad), SLOTS_FILL=_SLOTS_FILL,
                               num_warps=4 if pairs_pad <= 1024 else 8, **common.pdl_options(flat, "pdl_decode"))
    return sorted_ids, expert_ids, num_padded
