"""Fused MoE: the Triton kernel (interpreted on CPU) and its reference against a float64 loop over tokens and
their chosen experts, written here.

Bound, from the roundings the op is specified to make: the intermediate `act(gate) * up` is rounded once to the
dtype (relative error u per element, carried through `|w2| @ |inter|` and the routing weight) and the output
once (u * |out|); fp32 accumulation adds at most a few (H + I + k) fp32 units of the magnitudes involved.
Shapes are small and not multiples of the test blocks (so partial row, column and K tiles all occur); routing
leaves an expert without tokens, repeats experts across tokens and sends more than a block of pairs to one.
Pairs of expert -1 (another expert-parallel rank's) contribute nothing.

FP8 experts (per channel and block-wise) against a float64 oracle that fake-quantizes as the op specifies: x's
quantization is the same computation on the same input, so it is shared exactly. The intermediate's is
shared wherever the oracle can prove it: the kernel's (and the reference's) fp32 intermediate lies within a
bound `delta` of the float64 one, and an element whose rounding to x's dtype and then to e4m3 (scale
included) gives one value over the whole interval is quantized identically; the rare others are allowed the
difference between two roundings. The rest of the bound is fp32 accumulation and the output's rounding.
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
import torch.nn.functional as F

from kestrel import ops
from kestrel.kernels import fused_moe as fm
from kestrel.kernels.activation import ACTIVATIONS
from kestrel.kernels.common import FP8_DOT_MIN_K
from kestrel.kernels.fused_moe import MoEConfig, fused_moe, fused_moe_ref, moe_align
from kestrel.kernels.moe_routing import moe_align_single, route_topk, route_topk_ref

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FP32 = 2.0**-24
SMALL = MoEConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=1, num_stages=1)

# (T, E, k, H, I): every T x E x k; H, I between 32-64 and 16-48, mostly off the test blocks' multiples.
SHAPES = [
    (1, 4, 1, 32, 16), (1, 4, 2, 48, 24), (1, 8, 1, 40, 20), (1, 8, 2, 64, 48),
    (3, 4, 1, 48, 40), (3, 4, 2, 32, 16), (3, 8, 1, 64, 24), (3, 8, 2, 40, 36),
    (17, 4, 1, 64, 48), (17, 4, 2, 40, 20), (17, 8, 1, 32, 16), (17, 8, 2, 48, 24),
]
DTYPES = [torch.float32, torch.bfloat16]


def oracle_act(g: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return g / (1.0 + torch.exp(-g))
    if activation == "gelu":
        return 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0)))
    return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))


def oracle(x, w13, w2, topk_weights, topk_ids, activation):
    """float64, token by token (pairs of expert -1 skipped): (exact output, |w| |w2| @ |inter|,
    |w| |w2| @ (|gate terms| * |up terms|))."""
    T, H = x.shape
    inter = w13.shape[1] // 2
    xd, w13d, w2d = x.double(), w13.double(), w2.double()
    out = torch.zeros(T, H, dtype=torch.float64)
    mag = torch.zeros(T, H, dtype=torch.float64)
    mag_terms = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            w = float(topk_weights[t, j])
            gate = w13d[e, :inter] @ xd[t]
            up = w13d[e, inter:] @ xd[t]
            h = oracle_act(gate, activation) * up
            out[t] += w * (w2d[e] @ h)
            mag[t] += abs(w) * (w2d[e].abs() @ h.abs())
            terms = (w13d[e, :inter].abs() @ xd[t].abs()) * (w13d[e, inter:].abs() @ xd[t].abs())
            mag_terms[t] += abs(w) * (w2d[e].abs() @ terms)
    return out, mag, mag_terms


def check(out: torch.Tensor, args: tuple, activation: str) -> None:
    x, w13 = args[0], args[1]
    exact, mag, mag_terms = oracle(*args, activation)
    assert out.dtype == x.dtype and out.shape == exact.shape
    u = UNIT_ROUNDOFF[x.dtype]
    fp32_slack = 4 * (x.shape[1] + w13.shape[1] // 2 + args[4].shape[1]) * FP32
    bound = u * exact.abs() + u * mag + fp32_slack * (mag + mag_terms) + 1e-30
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3f}"


def routing(T: int, E: int, k: int, seed: int, ids_dtype: torch.dtype, skip_last: bool = True):
    """Distinct experts per token drawn from all but the last expert (which then receives no token)."""
    g = torch.Generator().manual_seed(seed)
    pool = E - 1 if skip_last else E
    ids = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(T)]).to(ids_dtype)
    weights = torch.rand(T, k, generator=g) + 0.05
    return weights, ids


def skip_pairs(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Marks about a third of the pairs, and all of token 0's, as another rank's (expert -1), in place."""
    g = torch.Generator().manual_seed(seed + 77)
    ids[torch.rand(ids.shape, generator=g) < 0.35] = -1
    ids[0] = -1
    return ids


def make_inputs(T, E, k, H, inter, dtype, seed=0, ids_dtype=torch.int32):
    g = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) / math.sqrt(inter)).to(dtype)
    weights, ids = routing(T, E, k, seed, ids_dtype)
    return x, w13, w2, weights, ids


def cases():
    for i, shape in enumerate(SHAPES):
        for j, dtype in enumerate(DTYPES):
            activation = ACTIVATIONS[(i + j) % len(ACTIVATIONS)]
            yield pytest.param(shape, dtype, activation, id=f"{shape}-{str(dtype)[6:]}-{activation}")


# ------------------------------------------------------------------------------------- against the oracle


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_matches_oracle(shape, dtype, activation):
    args = make_inputs(*shape, dtype, seed=sum(shape), ids_dtype=torch.int64 if shape[2] == 2 else torch.int32)
    check(fused_moe_ref(*args, activation), args, activation)


@pytest.mark.parametrize("shape,dtype,activation", list(cases()))
def test_kernel_matches_oracle(shape, dtype, activation, device):
    args = make_inputs(*shape, dtype, seed=sum(shape), ids_dtype=torch.int64 if shape[0] == 3 else torch.int32)
    out = fused_moe(*(a.to(device) for a in args), activation, config=SMALL)
    check(out.cpu(), args, activation)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_kernel_one_expert_over_several_blocks(dtype, device):
    """17 tokens x 2 slots on experts 1 and 3 only: three blocks each, two experts idle; default config too."""
    x, w13, w2, _, _ = make_inputs(17, 4, 2, 40, 20, dtype, seed=7)
    ids = torch.tensor([[1, 3], [3, 1]] * 8 + [[1, 3]], dtype=torch.int64)
    weights = torch.rand(17, 2, generator=torch.Generator().manual_seed(3))
    args = (x, w13, w2, weights, ids)
    for cfg in (SMALL, None):
        out = fused_moe(*(a.to(device) for a in args), "silu", config=cfg)
        check(out.cpu(), args, "silu")
    check(fused_moe_ref(*args, "silu"), args, "silu")


def test_bf16_rounds_the_intermediate_once(device):
    """The intermediate is held in bf16: the kernel and the reference both differ from an fp32-intermediate
    MLP by about the bf16 rounding of the intermediate, and agree with each other far more closely."""
    args = make_inputs(17, 8, 2, 64, 48, torch.bfloat16, seed=5)
    ref = fused_moe_ref(*args, "gelu")
    out = fused_moe(*(a.to(device) for a in args), "gelu", config=SMALL).cpu()
    exact = oracle(*args, "gelu")[0]
    assert (out.double() - ref.double()).abs().max() <= 2.0**-7 * ref.double().abs().max()
    assert (ref.double() - exact).abs().max() > 0  # a real bf16 path, not an fp32 one


@pytest.mark.parametrize("T,k,dtype", [(6, 2, torch.bfloat16), (5, 1, torch.float32), (9, 3, torch.float32)])
def test_skipped_experts(T, k, dtype, device):
    """Pairs of expert -1 contribute nothing (token 0 has no expert at all: its output is exactly 0)."""
    args = make_inputs(T, 4, k, 40, 24, dtype, seed=T + k)
    skip_pairs(args[4], seed=T)
    out = fused_moe(*(a.to(device) for a in args), "silu", config=SMALL).cpu()
    check(out, args, "silu")
    assert bool((out[0] == 0).all())
    check(fused_moe_ref(*args, "silu"), args, "silu")


# ---------------------------------------------------------------------------------------------- FP8

# (T, E, k, H, I, x dtype, block_shape or None, activation, skip some pairs, config)
FP8_CASES = [
    (1, 4, 2, 32, 32, torch.bfloat16, None, "silu", False, SMALL),
    (5, 4, 2, 48, 40, torch.float32, None, "gelu_tanh", True, SMALL),
    (17, 4, 2, 64, 64, torch.bfloat16, None, "silu", True, None),
    (1, 4, 1, 32, 48, torch.float16, (16, 16), "silu", False, SMALL),
    (5, 4, 2, 40, 32, torch.bfloat16, (16, 16), "gelu", True, SMALL),
    (17, 4, 2, 64, 48, torch.float32, (16, 16), "silu", True, SMALL),
    (17, 4, 2, 48, 64, torch.bfloat16, (32, 16), "silu", True, SMALL),
    (5, 4, 2, 64, 40, torch.bfloat16, (8, 32), "silu", False, SMALL),
    (5, 4, 2, 192, 128, torch.bfloat16, (128, 128), "silu", True, SMALL),  # the checkpoints' block, K tail
]


def fp8_case_id(case) -> str:
    T, E, k, H, inter, dtype, block, activation, skip, cfg = case
    return (f"T{T}-k{k}-H{H}-I{inter}-{str(dtype)[6:]}-{'channel' if block is None else f'block{block[0]}x{block[1]}'}"
            f"-{activation}{'-skip' if skip else ''}{'-default' if cfg is None else ''}")


def quantize_weight(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> e4m3 weights and fp32 scales (amax / 448 per row, or per bn x bk block)."""
    E, N, K = w.shape
    if block is None:
        s = w.abs().amax(-1) / 448.0
        return (w / s[..., None]).to(torch.float8_e4m3fn), s
    bn, bk = block
    nb, kb = -(-N // bn), -(-K // bk)
    blocks = F.pad(w, (0, kb * bk - K, 0, nb * bn - N)).reshape(E, nb, bn, kb, bk)
    s = blocks.abs().amax(dim=(2, 4)) / 448.0
    q = (blocks / s[:, :, None, :, None]).reshape(E, nb * bn, kb * bk)[:, :N, :K]
    return q.to(torch.float8_e4m3fn), s


def dequantize_weight(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    if block is None:
        return q.double() * s.double()[..., None]
    N, K = q.shape[1:]
    return q.double() * s.double().repeat_interleave(block[0], 1)[:, :N].repeat_interleave(block[1], 2)[:, :, :K]


def make_fp8_inputs(T, E, k, H, inter, dtype, block, skip, seed):
    """x, e4m3 w13 / w2 (rows of mixed magnitudes, so scales differ) with their scales, a routing."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * torch.exp(torch.randn(T, 1, generator=g))).to(dtype)
    w13 = torch.randn(E, 2 * inter, H, generator=g) * torch.exp(0.5 * torch.randn(E, 2 * inter, 1, generator=g))
    w2 = torch.randn(E, H, inter, generator=g) * torch.exp(0.5 * torch.randn(E, H, 1, generator=g))
    q13, s13 = quantize_weight(w13 / math.sqrt(H), block)
    q2, s2 = quantize_weight(w2 / math.sqrt(inter), block)
    weights, ids = routing(T, E, k, seed, torch.int32)
    if skip:
        skip_pairs(ids, seed)
    return (x, q13, q2, weights, ids), dict(w13_scale=s13, w2_scale=s2, block_shape=block)


def fake_quant(y: torch.Tensor, group: int | None, scale: torch.Tensor | None = None):
    """fp32 y [R, C] quantized to e4m3 as specified (s = max(amax / 448, 1e-12) per row or per row and group of
    columns, q = rne(sat(y * fp32(1 / s)))): q as float64 [R, C] and the fp32 scales [R, G]."""
    R, C = y.shape
    width = group or C
    G = -(-C // width)
    blocks = F.pad(y, (0, G * width - C)).reshape(R, G, width)
    s = (blocks.abs().amax(-1) / 448.0).clamp(min=1e-12) if scale is None else scale
    q = (blocks * (1.0 / s)[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.double().reshape(R, G * width)[:, :C], s


def oracle_fp8(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, block_shape,
               quantize_intermediate=True):
    """float64 over all kept pairs at once: (output, magnitude for the fp32 terms, allowance for the
    intermediate's quantization differences, fraction of intermediate elements whose e4m3 value may differ).
    `quantize_intermediate=False`: the output of an op that forgot to quantize the intermediate."""
    T, H = x.shape
    inter = w13.shape[1] // 2
    group = block_shape[1] if block_shape is not None else None
    width = group or inter
    fp32 = x.dtype == torch.float32
    w13d, w2d = dequantize_weight(w13, w13_scale, block_shape), dequantize_weight(w2, w2_scale, block_shape)
    xq, xs = fake_quant(x.float(), group)
    xq = xq * xs.double().repeat_interleave(group or H, 1)[:, :H]
    t_idx, j_idx = (topk_ids >= 0).nonzero(as_tuple=True)
    e = topk_ids[t_idx, j_idx].long()
    w = topk_weights[t_idx, j_idx].double()
    gate_up = torch.einsum("pnh,ph->pn", w13d[e], xq[t_idx])
    mags = torch.einsum("pnh,ph->pn", w13d[e].abs(), xq[t_idx].abs())
    gate, up, g_mag, u_mag = gate_up[:, :inter], gate_up[:, inter:], mags[:, :inter], mags[:, inter:]
    act = oracle_act(gate, activation)
    h = act * up
    # |fp32 intermediate - h|: the GEMMs' fp32 sums (the classical bound, with the dequantization's roundings),
    # act's slope (< 1.2), the activation's and the product's evaluation in fp32.
    d_gate, d_up = 1.01 * (H + 4) * FP32 * g_mag, 1.01 * (H + 4) * FP32 * u_mag
    delta = (1.2 * d_gate * (up.abs() + d_up) + (act.abs() + 1.2 * d_gate) * d_up
             + 16 * FP32 * (gate.abs() + act.abs()) * (up.abs() + d_up))

    def to_x(y):  # onto x's grid (through fp32, as the kernel rounds), as fp32
        return y.float() if fp32 else y.float().to(x.dtype).float()

    def per_element(s):
        return s.double().repeat_interleave(width, 1)[:, :inter]

    mid, lo, hi = to_x(h), to_x(h - delta), to_x(h + delta)
    q, s = fake_quant(mid, group)
    dq = q * per_element(s) if quantize_intermediate else mid.double()
    # Every fp32 intermediate within delta rounds into [lo, hi]; its group's amax, so its scale, lies
    # between those of the smallest and the largest magnitudes there. The e4m3 value is monotone in the value
    # and in the scale: equal at the corners means equal over the whole box.
    m_lo = torch.where(lo * hi > 0, torch.minimum(lo.abs(), hi.abs()), torch.zeros_like(lo))
    m_hi = torch.maximum(lo.abs(), hi.abs())
    s_lo, s_hi = fake_quant(m_lo, group)[1], fake_quant(m_hi, group)[1]
    flip = torch.zeros_like(q, dtype=torch.bool)
    for y in (lo, hi):
        for sc in (s_lo, s_hi):
            flip |= fake_quant(y, group, sc)[0] != q
    # Same e4m3 value: only the scale may differ. Otherwise two roundings to e4m3 (a step at the largest
    # scale and value), the interval, fp32 slack.
    v_max = (m_hi.double() / per_element(s_lo)).clamp(max=448.0) * (1 + 2.0**-20)
    step = torch.exp2(torch.floor(torch.log2(v_max.clamp(min=2.0**-6))) - 3)
    allow = torch.where(flip, per_element(s_hi) * step + (hi - lo).double() + 8 * FP32 * m_hi.double(),
                        q.abs() * per_element(s_hi - s_lo))

    out = torch.zeros(T, H, dtype=torch.float64)
    mag = torch.zeros(T, H, dtype=torch.float64)
    slack = torch.zeros(T, H, dtype=torch.float64)
    out.index_add_(0, t_idx, w[:, None] * torch.einsum("phi,pi->ph", w2d[e], dq))
    mag.index_add_(0, t_idx, w.abs()[:, None] * torch.einsum("phi,pi->ph", w2d[e].abs(), dq.abs() + allow))
    slack.index_add_(0, t_idx, w.abs()[:, None] * torch.einsum("phi,pi->ph", w2d[e].abs(), allow))
    return out, mag, slack, flip.double().mean().item() if flip.numel() else 0.0


def check_fp8(out: torch.Tensor, args: tuple, quant: dict, activation: str) -> None:
    x, w13 = args[0], args[1]
    exact, mag, slack, flipped = oracle_fp8(*args, activation, **quant)
    assert out.dtype == x.dtype and out.shape == exact.shape
    assert flipped < 0.1  # the allowance is the exception (mostly small values): the bound stays tight
    u = UNIT_ROUNDOFF[x.dtype]
    inter = w13.shape[1] // 2
    bound = u * exact.abs() + (1 + u) * (2 * (inter + args[4].shape[1] + 8) * FP32 * mag + slack) + 1e-30
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3f}"


@pytest.mark.parametrize("case", FP8_CASES, ids=fp8_case_id)
def test_fp8_reference_matches_oracle(case):
    T, E, k, H, inter, dtype, block, activation, skip, _ = case
    args, quant = make_fp8_inputs(T, E, k, H, inter, dtype, block, skip, seed=T + H + inter)
    check_fp8(fused_moe_ref(*args, activation, **quant), args, quant, activation)


@pytest.mark.parametrize("case", FP8_CASES, ids=fp8_case_id)
def test_fp8_kernel_matches_oracle(case, device):
    T, E, k, H, inter, dtype, block, activation, skip, cfg = case
    args, quant = make_fp8_inputs(T, E, k, H, inter, dtype, block, skip, seed=T + H + inter)
    on_device = {name: v.to(device) if isinstance(v, torch.Tensor) else v for name, v in quant.items()}
    if device.type == "cuda" and block is not None and block[1] < FP8_DOT_MIN_K:
        with pytest.raises(ValueError, match=r"block_shape=\(\d+, 16\).* at least 32"):
            fused_moe(*(a.to(device) for a in args), activation, config=cfg, small_t=False, **on_device)
        return
    out = fused_moe(*(a.to(device) for a in args), activation, config=cfg, **on_device).cpu()
    check_fp8(out, args, quant, activation)
    if skip:
        assert bool((out[0] == 0).all())


@pytest.mark.parametrize("block", [None, (16, 16)], ids=["channel", "block"])
def test_fp8_bound_sees_missing_quantization(block):
    """The check tells the specified quantization from a near miss: the op without the intermediate's
    quantization, and dequantized weights with unquantized activations, both land outside the bound."""
    args, quant = make_fp8_inputs(17, 4, 2, 64, 48, torch.bfloat16, block, True, seed=1)
    check_fp8(fused_moe_ref(*args, **quant), args, quant, "silu")
    without = oracle_fp8(*args, "silu", **quant, quantize_intermediate=False)[0].to(torch.bfloat16)
    with pytest.raises(AssertionError, match="max err/bound"):
        check_fp8(without, args, quant, "silu")
    w13 = dequantize_weight(args[1], quant["w13_scale"], block).to(torch.bfloat16)
    w2 = dequantize_weight(args[2], quant["w2_scale"], block).to(torch.bfloat16)
    with pytest.raises(AssertionError, match="max err/bound"):
        check_fp8(fused_moe_ref(args[0], w13, w2, args[3], args[4]), args, quant, "silu")


def test_fp8_arguments():
    args, quant = make_fp8_inputs(3, 4, 2, 32, 32, torch.bfloat16, (16, 16), False, seed=2)
    assert torch.equal(ops.fused_moe(*args, **quant), fused_moe_ref(*args, **quant))  # CPU: the reference
    channel_args, channel = make_fp8_inputs(3, 4, 2, 32, 32, torch.bfloat16, None, False, seed=2)
    trailing = dict(channel, w13_scale=channel["w13_scale"][..., None], w2_scale=channel["w2_scale"][..., None])
    assert torch.equal(fused_moe_ref(*channel_args, **trailing), fused_moe_ref(*channel_args, **channel))
    with pytest.raises(ValueError, match="multiple of bn=64"):
        fused_moe_ref(*args, **dict(quant, block_shape=(64, 16)))
    with pytest.raises(ValueError, match=r"block \(16, 32\) scales must be"):
        fused_moe(*args, **dict(quant, block_shape=(16, 32)))
    with pytest.raises(ValueError, match="per-channel scales must be"):
        fused_moe_ref(*args, **dict(quant, block_shape=None))
    with pytest.raises(ValueError, match="need w13_scale and w2_scale"):
        fused_moe_ref(*args)
    with pytest.raises(ValueError, match="float32"):
        fused_moe_ref(*args, **dict(quant, w2_scale=quant["w2_scale"].bfloat16()))
    plain = make_inputs(3, 4, 2, 32, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn experts only"):
        fused_moe_ref(*plain, block_shape=(16, 16))
    with pytest.raises(ValueError, match="float8_e4m3fn w13 and w2"):
        fused_moe_ref(args[0], args[1], args[2].bfloat16(), *args[3:], **quant)


def test_fp8_intermediate_split_over_ranks_with_the_group_amax(device):
    """Per-channel FP8 with each expert's intermediate split in two (tensor parallelism): with the halves' row absmax
    max-reduced (`reduce_inter_amax`), the float32 halves sum to the one-call output; with each half's own scale they
    do not (by about 2%)."""
    args, quant = make_fp8_inputs(13, 4, 2, 64, 48, torch.float32, None, False, seed=3)
    x, q13, q2, weights, ids = (a.to(device) for a in args)
    s13, s2 = quant["w13_scale"].to(device), quant["w2_scale"].to(device)
    halves = []
    for r in range(2):
        cols = torch.arange(24 * r, 24 * (r + 1))
        rows = torch.cat([cols, 48 + cols]).to(device)  # this rank's gate rows, then its up rows
        halves.append((q13[:, rows].contiguous(), s13[:, rows].contiguous(), q2[:, :, cols.to(device)].contiguous()))
    for fn in (functools.partial(fused_moe, config=SMALL), fused_moe_ref):
        def run(half, reduce=None, fn=fn):
            a, sa, b = half
            return fn(x, a, b, weights, ids, w13_scale=sa, w2_scale=s2, reduce_inter_amax=reduce)

        full = fn(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2).cpu()
        seen: list[torch.Tensor] = []
        for half in halves:
            run(half, lambda m, seen=seen: seen.append(m.clone()) or m)
        group = torch.maximum(*seen)
        split = sum(run(half, lambda m, group=group: group.clone()) for half in halves).cpu()
        local = sum(run(half) for half in halves).cpu()
        assert (split - full).abs().max() <= 1e-6 * full.abs().max()
        assert (local - full).abs().max() > 1e-3 * full.abs().max()
    with pytest.raises(ValueError, match="per-channel FP8 experts only"):
        fused_moe_ref(*make_inputs(3, 4, 2, 32, 16, torch.float32), reduce_inter_amax=lambda m: m)


# ------------------------------------------------------------------------------------------------ routing


ALIGNS = {"torch_sort": moe_align, "single_program": moe_align_single}


@pytest.mark.parametrize("skip", [False, True], ids=["all", "skip"])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("T,E,k,block_m", [(1, 4, 1, 16), (5, 8, 2, 4), (17, 4, 2, 4), (9, 3, 3, 16),
                                           (70, 128, 8, 16)])
@pytest.mark.parametrize("align", list(ALIGNS), ids=str)
def test_align_layout(T, E, k, block_m, ids_dtype, skip, align, device):
    _, ids = routing(T, E, k, seed=T + E, ids_dtype=ids_dtype, skip_last=T > 1 and k < E)
    if skip:
        skip_pairs(ids, seed=T)
    sorted_ids, expert_ids, num_padded = (t.cpu() for t in ALIGNS[align](ids.to(device), E, block_m))
    n = T * k
    assert sorted_ids.dtype == expert_ids.dtype == num_padded.dtype == torch.int32
    assert sorted_ids.numel() == expert_ids.numel() * block_m
    assert expert_ids.numel() == -(-(n + min(E, n) * (block_m - 1)) // block_m)
    flat = ids.reshape(-1).long()
    kept = (flat >= 0).nonzero().reshape(-1).tolist()
    counts = torch.bincount(flat[flat >= 0], minlength=E)
    padded = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(num_padded) == padded
    real = sorted_ids[:padded]
    assert bool((sorted_ids[padded:] == n).all())
    assert sorted(real[real < n].tolist()) == kept  # every kept pair exactly once, skipped pairs nowhere
    for b in range(padded // block_m):
        block = sorted_ids[b * block_m:(b + 1) * block_m]
        pairs = block[block < n].long()
        assert pairs.numel() > 0 and bool((flat[pairs] == int(expert_ids[b])).all())
        assert bool((pairs.diff() > 0).all())  # stable: token order kept within an expert
    assert list(expert_ids[:padded // block_m]) == sorted(expert_ids[:padded // block_m].tolist())


@pytest.mark.parametrize("T,E,k,block_m", [(1, 128, 8, 16), (6, 4, 2, 4), (40, 60, 6, 32), (128, 128, 8, 64),
                                           (500, 128, 8, 16)])  # 4,000 pairs: past the default limit, 8 warps
@pytest.mark.parametrize("skipped", ["some", "all"])
def test_single_program_align_equals_torch_sort(T, E, k, block_m, skipped, device):
    """The one-launch alignment gives the torch sort's outputs exactly, padding blocks' experts included, also
    when an expert-parallel rank owns none of the step's experts (every id -1)."""
    _, ids = routing(T, E, k, seed=3 * T + E, ids_dtype=torch.int64)
    skip_pairs(ids, seed=E)
    if skipped == "all":
        ids.fill_(-1)
    want = moe_align(ids, E, block_m)
    got = moe_align_single(ids.to(device), E, block_m)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and g.cpu().tolist() == w.tolist()


def route_oracle(logits: torch.Tensor, k: int, renormalize: bool, scoring: str = "softmax", num_groups: int = 1,
                 topk_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 softmax (or sigmoid); the k largest by value, the lowest index first among equals; with groups, only
    among the experts of the topk_groups groups whose best expert scores highest (the lower group first)."""
    logits = logits.double()
    probs = torch.softmax(logits, dim=-1) if scoring == "softmax" else 1.0 / (1.0 + torch.exp(-logits))
    per_group = probs.shape[1] // num_groups
    rows = []
    for row in probs:
        best = [max(float(v) for v in row[g * per_group:(g + 1) * per_group]) for g in range(num_groups)]
        groups = sorted(range(num_groups), key=lambda g: (-best[g], g))[:topk_groups]
        allowed = [e for e in range(row.numel()) if e // per_group in groups]
        rows.append(torch.tensor(sorted(allowed, key=lambda e, r=row: (-float(r[e]), e))[:k]))
    ids = torch.stack(rows)
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("T,E,k,dtype", [(1, 128, 8, torch.bfloat16), (5, 8, 2, torch.float32),
                                         (9, 60, 4, torch.float32), (3, 3, 3, torch.bfloat16)])
def test_route_topk_matches_float64(T, E, k, dtype, renormalize, device):
    g = torch.Generator().manual_seed(T * E + k)
    logits = (torch.randn(T, E, generator=g) * 2).to(dtype)
    want_w, want_ids = route_oracle(logits, k, renormalize)
    for fn in (route_topk, route_topk_ref):
        weights, ids = fn(logits.to(device), k, renormalize)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and weights.shape == (T, k)
        assert ids.cpu().tolist() == want_ids.tolist()
        torch.testing.assert_close(weights.cpu().double(), want_w, rtol=4 * FP32, atol=4 * FP32)


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("T,E,k,dtype", [(1, 128, 8, torch.bfloat16), (9, 60, 4, torch.float32),
                                         (4, 16, 1, torch.float32)])
def test_sigmoid_routing_matches_float64(T, E, k, dtype, renormalize, device):
    """Each logit's sigmoid as the expert's score (the routers of DeepSeek-V3 and Llama 4), renormalized or not."""
    g = torch.Generator().manual_seed(T * E + k + 7)
    logits = (torch.randn(T, E, generator=g) * 2).to(dtype)
    want_w, want_ids = route_oracle(logits, k, renormalize, "sigmoid")
    for fn in (route_topk, route_topk_ref):
        weights, ids = fn(logits.to(device), k, renormalize, "sigmoid")
        assert ids.cpu().tolist() == want_ids.tolist()
        torch.testing.assert_close(weights.cpu().double(), want_w, rtol=4 * FP32, atol=4 * FP32)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("E,groups,topk_groups,k", [(16, 4, 2, 4), (64, 8, 3, 6), (12, 3, 1, 4)])
def test_grouped_routing_chooses_only_within_the_best_groups(E, groups, topk_groups, k, scoring, device):
    g = torch.Generator().manual_seed(E + groups * 10 + k)
    logits = torch.randn(7, E, generator=g) * 2
    want_w, want_ids = route_oracle(logits, k, True, scoring, groups, topk_groups)
    for fn in (route_topk, route_topk_ref):
        weights, ids = fn(logits.to(device), k, True, scoring, groups, topk_groups)
        assert ids.cpu().tolist() == want_ids.tolist()
        torch.testing.assert_close(weights.cpu().double(), want_w, rtol=4 * FP32, atol=4 * FP32)
        chosen_groups = (ids.cpu() // (E // groups)).tolist()
        assert all(len(set(row)) <= topk_groups for row in chosen_groups)


def test_routing_refuses_what_it_cannot_route_naming_it():
    logits = torch.randn(2, 12)
    for kwargs, match in (({"scoring": "softplus"}, "scoring='softplus'"),
                          ({"num_groups": 5}, "num_groups=5 must divide the 12 experts"),
                          ({"num_groups": 4, "topk_groups": 5}, "topk_groups=5 must be in 1..num_groups=4"),
                          ({"num_groups": 4, "topk_groups": 1, "top_k": 4}, "top_k=4 must be in 1..3")):
        kwargs = {"top_k": 2, **kwargs}
        for fn in (route_topk, route_topk_ref):
            with pytest.raises(ValueError, match=re.escape(match)):
                fn(logits, renormalize=True, **kwargs)


def test_route_topk_ties_take_the_lowest_index(device):
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 0.5]])
    weights, ids = route_topk(logits.to(device), 4, renormalize=False)
    assert ids.cpu().tolist() == [[1, 2, 4, 0]]
    want, _ = route_oracle(logits, 4, False)
    torch.testing.assert_close(weights.cpu().double(), want, rtol=4 * FP32, atol=4 * FP32)


def test_route_topk_picks_real_experts_for_nan_logits(device):
    """A row with a NaN logit (its softmax is all NaN) still picks k distinct real experts, so the alignment never
    indexes past the experts (a device-side assert on the GPU); other rows are unaffected."""
    logits = torch.tensor([[0.5, float("nan"), 2.0, -1.0, 1.0, 0.5],
                           [float("nan")] * 6,
                           [0.5, 3.0, 2.0, -1.0, 1.0, 0.5]])
    _, ids = route_topk(logits.to(device), 3, renormalize=True)
    for row in ids.cpu().tolist()[:2]:
        assert len(set(row)) == 3 and all(0 <= i < 6 for i in row)
    assert ids.cpu().tolist()[2] == [1, 2, 4]


# ------------------------------------------------------------------------------------ config and dispatch


def test_default_table_and_lookup():
    entries = fm.load_table(fm.DEFAULT_TABLE)
    assert entries, "the shipped default table is missing"
    for bucket, cfg in entries.items():
        parsed = MoEConfig.from_json(cfg)
        assert int(bucket) >= 1 and parsed.block_m in (16, 32, 64) and parsed.block_n in (64, 128)
        assert parsed.block_k in (64, 128) and parsed.to_json() == cfg
    small = {"1": SMALL.to_json(), "64": MoEConfig(32, 64, 64).to_json()}
    assert fm.lookup(small, 1) == SMALL
    assert fm.lookup(small, 2) == fm.lookup(small, 64) == fm.lookup(small, 10_000) == MoEConfig(32, 64, 64)
    assert fm.lookup({}, 3) is None
    assert fm.select_config(8, 64, 128, 3, torch.device("cpu")) == fm.lookup(entries, 3)


def test_gpu_table_entries_by_weight_kind(monkeypatch):
    """A tuned table holds entries per weight kind; FP8 weights without their own take the shape's 16-bit entry,
    a shape without any the default table's."""
    bf16, fp8 = MoEConfig(16, 64, 128), MoEConfig(16, 128, 256, num_warps=8)
    table = {"8,64,128,bf16": {"16": bf16.to_json()}, "8,64,128,fp8_channel": {"16": fp8.to_json()}}
    monkeypatch.setattr(fm.common, "gpu_table", lambda kernel, device: table if kernel == "fused_moe" else {})
    cpu = torch.device("cpu")
    assert fm.select_config(8, 32, 128, 3, cpu) == bf16
    assert fm.select_config(8, 32, 128, 3, cpu, "fp8_channel") == fp8
    assert fm.select_config(8, 32, 128, 3, cpu, "fp8_block") == bf16
    assert fm.select_config(8, 16, 128, 3, cpu, "fp8_channel") == fm.lookup(fm.load_table(fm.DEFAULT_TABLE), 3)


def test_shipped_gpu_tables_name_a_weight_kind():
    for path in fm.common.TUNING_DIR.glob("fused_moe_*.json"):
        if path == fm.DEFAULT_TABLE:
            continue
        for key, entries in fm.load_table(path).items():
            assert key.rsplit(",", 1)[1] in ("bf16", "fp8_channel", "fp8_block"), (path.name, key)
            assert all(MoEConfig.from_json(cfg).to_json() == cfg for cfg in entries.values())


def test_ops_dispatch_and_edge_cases():
    args = make_inputs(3, 4, 2, 32, 16, torch.float32, seed=1)
    assert torch.equal(ops.fused_moe(*args, "gelu_tanh"), fused_moe_ref(*args, "gelu_tanh"))
    empty = (args[0][:0], args[1], args[2], args[3][:0], args[4][:0])
    assert fused_moe_ref(*empty).shape == (0, 32) and fused_moe(*empty, config=SMALL).shape == (0, 32)
    with pytest.raises(ValueError, match="unknown activation"):
        fused_moe_ref(*args, "relu")
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe_ref(args[0], args[1], args[2][:, :, :8], args[3], args[4])
    with pytest.raises(ValueError, match="int32 or int64"):
        fused_moe_ref(*args[:4], args[4].float())
