"""Fused MoE: the Triton kernel (interpreted on CPU) and its reference against a float64 loop over tokens and
their chosen experts, written here.

Bound, from the roundings the op is specified to make: the intermediate `act(gate) * up` is rounded once to the
dtype (relative error u per element, carried through `|w2| @ |inter|` and the routing weight) and the output
once (u * |out|); fp32 accumulation adds at most a few (H + I + k) fp32 units of the magnitudes involved.
Shapes are small and not multiples of the test blocks (so partial row, column and K tiles all occur); routing
leaves an expert without tokens, repeats experts across tokens and sends more than a block of pairs to one.
"""

from __future__ import annotations

import math

import pytest
import torch

from kestrel import ops
from kestrel.kernels import fused_moe as fm
from kestrel.kernels.activation import ACTIVATIONS
from kestrel.kernels.fused_moe import MoEConfig, fused_moe, fused_moe_ref, moe_align

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
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
    """float64, token by token: (exact output, |w| |w2| @ |inter|, |w| |w2| @ (|gate terms| * |up terms|))."""
    T, H = x.shape
    inter = w13.shape[1] // 2
    xd, w13d, w2d = x.double(), w13.double(), w2.double()
    out = torch.zeros(T, H, dtype=torch.float64)
    mag = torch.zeros(T, H, dtype=torch.float64)
    mag_terms = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
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


# ------------------------------------------------------------------------------------------------ routing


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("T,E,k,block_m", [(1, 4, 1, 16), (5, 8, 2, 4), (17, 4, 2, 4), (9, 3, 3, 16)])
def test_align_layout(T, E, k, block_m, ids_dtype):
    _, ids = routing(T, E, k, seed=T + E, ids_dtype=ids_dtype, skip_last=T > 1 and k < E)
    sorted_ids, expert_ids, num_padded = moe_align(ids, E, block_m)
    n = T * k
    assert sorted_ids.dtype == expert_ids.dtype == num_padded.dtype == torch.int32
    assert sorted_ids.numel() == expert_ids.numel() * block_m
    assert expert_ids.numel() == -(-(n + min(E, n) * (block_m - 1)) // block_m)
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=E)
    padded = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(num_padded) == padded
    real = sorted_ids[:padded]
    assert bool((sorted_ids[padded:] == n).all())
    assert sorted(real[real < n].tolist()) == list(range(n))  # every pair exactly once
    for b in range(padded // block_m):
        block = sorted_ids[b * block_m:(b + 1) * block_m]
        pairs = block[block < n].long()
        assert pairs.numel() > 0 and bool((flat[pairs] == int(expert_ids[b])).all())
        assert bool((pairs.diff() > 0).all())  # stable: token order kept within an expert
    assert list(expert_ids[:padded // block_m]) == sorted(expert_ids[:padded // block_m].tolist())


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
