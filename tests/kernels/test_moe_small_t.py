"""The small-T fused MoE path (`kernels/moe_small_t.py`): the two GEMV launches (interpreted on CPU) and their
reference against test_fused_moe's float64 oracle and bound. FP8 experts keep the activations unquantized here
(W8A16), so their oracle is the bf16 one on the dequantized weights: the dequantization's one fp32 rounding per
weight is far inside the bound's fp32 slack. Shapes are small and off the tiles' multiples (partial N tiles and K
tails occur); routing repeats experts across tokens, and some pairs belong to another rank (expert -1).
"""

from __future__ import annotations

import dataclasses

import pytest
import sm90
import torch
from test_fused_moe import check, dequantize_weight, make_fp8_inputs, make_inputs, skip_pairs

from kestrel.kernels import common
from kestrel.kernels import fused_moe as fm
from kestrel.kernels import moe_small_t as st

TILES = st.SmallTConfig(max_tokens=8, block_n13=16, block_k13=32, block_n2=8, block_k2=16, num_warps=1,
                        num_warps2=1)
# The same tiles with the K steps in a loop rather than unrolled.
LOOPED = st.SmallTConfig(max_tokens=8, block_n13=16, block_k13=32, block_n2=8, block_k2=16, num_warps=1,
                         num_warps2=1, max_unroll=1)
# The down launch per pair, its k-sum by the last to arrive: the same operations in the same order, so the same bits.
SPLIT = dataclasses.replace(TILES, split_down=True)

# (T, E, k, H, I)
SHAPES = [(1, 4, 2, 48, 24), (2, 8, 2, 64, 40), (3, 4, 1, 40, 20), (8, 8, 3, 32, 16)]


def dequantized(args: tuple, quant: dict) -> tuple:
    x, q13, q2, weights, ids = args
    block = quant["block_shape"]
    return (x, dequantize_weight(q13, quant["w13_scale"], block), dequantize_weight(q2, quant["w2_scale"], block),
            weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_and_reference_match_oracle(shape, dtype, device, launch_features):
    T = shape[0]
    args = make_inputs(*shape, dtype, seed=sum(shape), ids_dtype=torch.int64 if T % 2 else torch.int32)
    activation = "silu" if T != 3 else "gelu_tanh"
    if T == 8:
        skip_pairs(args[4], seed=T)
    out = st.fused_moe_small_t(*(a.to(device) for a in args), activation, config=TILES).cpu()
    check(out, args, activation)
    looped = st.fused_moe_small_t(*(a.to(device) for a in args), activation, config=LOOPED).cpu()
    check(looped, args, activation)
    assert torch.equal(st.fused_moe_small_t(*(a.to(device) for a in args), activation, config=SPLIT).cpu(), out)
    assert not common.arrival_counters(torch.device(device)).any(), "the k-sum's counters were left set"
    check(st.fused_moe_small_t_ref(*args, activation), args, activation)
    if T == 8:
        assert bool((out[0] == 0).all())


# (T, E, k, H, I, x dtype, block_shape or None, activation, skip some pairs)
FP8_CASES = [
    (1, 4, 2, 48, 32, torch.bfloat16, None, "silu", False),
    (4, 4, 2, 40, 24, torch.float32, None, "gelu", True),
    (1, 4, 2, 64, 48, torch.bfloat16, (16, 16), "silu", False),
    (3, 4, 2, 40, 32, torch.bfloat16, (16, 16), "silu", True),  # K tails past the last scale column
    (2, 4, 2, 48, 64, torch.float16, (32, 8), "silu", False),  # sub-steps narrower than block_k
    (2, 4, 1, 40, 24, torch.bfloat16, (8, 24), "silu", False),  # bk not a power of two
]


@pytest.mark.parametrize("case", FP8_CASES, ids=str)
def test_fp8_weights_dequantized_in_registers(case, device):
    T, E, k, H, inter, dtype, block, activation, skip = case
    args, quant = make_fp8_inputs(T, E, k, H, inter, dtype, block, skip, seed=T + H + inter)
    on_device = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in quant.items()}
    oracle_args = dequantized(args, quant)
    outs = []
    for cfg in (TILES, LOOPED, SPLIT):
        outs.append(st.fused_moe_small_t(*(a.to(device) for a in args), activation, config=cfg, **on_device).cpu())
        check(outs[-1], oracle_args, activation)
        if skip:
            assert bool((outs[-1][0] == 0).all())
    assert torch.equal(outs[2], outs[0])
    check(st.fused_moe_small_t_ref(*args, activation, **quant), oracle_args, activation)


def test_per_channel_scale_with_trailing_one(device):
    args, quant = make_fp8_inputs(2, 4, 2, 32, 16, torch.bfloat16, None, False, seed=3)
    quant3 = dict(quant, w13_scale=quant["w13_scale"][..., None], w2_scale=quant["w2_scale"][..., None])
    on_device = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in quant3.items()}
    out = st.fused_moe_small_t(*(a.to(device) for a in args), "silu", config=TILES, **on_device).cpu()
    check(out, dequantized(args, quant), "silu")


def test_fused_moe_selects_the_path_by_t(device, monkeypatch):
    """None picks by T against DEFAULT.max_tokens; True / False / a config force it; the small path's FP8 output
    is the W8A16 one (it differs from the grouped GEMM's W8A8)."""
    args, quant = make_fp8_inputs(2, 4, 2, 32, 32, torch.bfloat16, None, False, seed=5)
    dev_args = tuple(a.to(device) for a in args)
    dev_quant = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in quant.items()}
    small = st.fused_moe_small_t(*dev_args, "silu", config=TILES, **dev_quant)
    grouped = fm.fused_moe(*dev_args, "silu", config=fm.MoEConfig(16, 16, 32, 1, 1, 1), small_t=False, **dev_quant)
    assert not torch.equal(small, grouped)
    assert torch.equal(fm.fused_moe(*dev_args, "silu", small_t=TILES, **dev_quant), small)
    monkeypatch.setattr(st, "DEFAULT", TILES)
    assert torch.equal(fm.fused_moe(*dev_args, "silu", **dev_quant), small)
    monkeypatch.setattr(st, "DEFAULT", st.SmallTConfig(max_tokens=1, block_n13=16, block_k13=32, block_n2=8,
                                                       block_k2=16, num_warps=1, num_warps2=1))
    assert st.select_small_t(1) is st.DEFAULT and st.select_small_t(2) is None and st.select_small_t(0) is None
    assert st.select_small_t(64, True) is st.DEFAULT and st.select_small_t(1, False) is None


def test_default_is_off_until_measured():
    assert st.DEFAULT.max_tokens == 0 and st.select_small_t(1) is None


def test_gpu_table_turns_the_path_on_per_shape_and_kind(monkeypatch):
    """A table entry for (E, 2I, H, kind) sets the tiles and the largest T; other shapes and kinds keep DEFAULT."""
    key = st.table_key(4, 16, 32, st.weight_kind(True, (16, 16)))
    assert key == "4,32,32,fp8_block" and st.weight_kind(False, None) == "bf16"
    entry = dict(TILES.to_json(), max_tokens=4)
    monkeypatch.setattr(st.common, "gpu_table", lambda kernel, device: {key: entry} if kernel == st.TABLE else {})
    device = torch.device("cpu")
    assert st.select_small_t(4, None, key, device) == st.SmallTConfig(**entry)
    assert st.select_small_t(5, None, key, device) is None
    assert st.select_small_t(1, None, st.table_key(4, 16, 32, "bf16"), device) is None
    assert st.select_small_t(1, False, key, device) is None


# ------------------------------------------------------------------------------ compiled for the H200, on the CPU

_QUANTS = {0: ("*bf16", (1, 1)), 1: ("*fp8e4nv", (1, 1)), 2: ("*fp8e4nv", (128, 128))}
def _sm90_reports(quant: int) -> list[tuple[str, str]]:
    """(PTX, ptxas report) of both launches with DEFAULT's tiles at the Qwen3-30B-A3B shape (E 128, k 8, H 2048,
    I 768). Run in a process without TRITON_INTERPRET (see the test)."""
    cfg, (wdt, (bn, bk)) = st.DEFAULT, _QUANTS[quant]
    H, inter, k = 2048, 768, 8
    block = None if quant != 2 else (bn, bk)
    common = dict(QUANT=quant, SCALE_BN=bn, SCALE_BK=bk, FAST=True, USE_PDL=True)
    gate_up = dict(ACTIVATION=0, EVEN_K=True, K_STEPS=H // cfg.block_k13, STATIC_K=True, BLOCK_N=cfg.block_n13,
                   BLOCK_K=cfg.block_k13, SUB=st._sub_width(cfg.block_k13, block), **common)
    steps = -(-inter // cfg.block_k2)
    down = dict(TOP_K=k, EVEN_K=inter % cfg.block_k2 == 0, K_STEPS=steps, STATIC_K=k * steps <= cfg.max_unroll,
                SPLIT=False, FUSED_SUM=False, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2,
                SUB=st._sub_width(cfg.block_k2, block), **common)
    down_ints = ["N", "K", "stride_im", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_om", "stride_sm"]
    down_pointers = {"inter_ptr": "*bf16", "w_ptr": wdt, "s_ptr": "*fp32", "ids_ptr": "*i64", "weights_ptr": "*fp32",
                     "out_ptr": "*bf16", "sum_ptr": "*bf16", "lock_ptr": "*i32"}
    # the split form with its k-sum by last arrival, as the H200 table runs it
    split = dict(down, SPLIT=True, FUSED_SUM=True, STATIC_K=steps <= cfg.max_unroll)
    return [
        sm90.compile_sm90(st._gate_up_kernel, {"x_ptr": "*bf16", "w_ptr": wdt, "s_ptr": "*fp32", "ids_ptr": "*i64",
                                           "inter_ptr": "*bf16"},
                      ["N", "K", "top_k", "stride_xm", "stride_we", "stride_wn", "stride_se", "stride_sn",
                       "stride_im"], gate_up, cfg.num_warps),
        sm90.compile_sm90(st._down_kernel, down_pointers, down_ints, down, cfg.num_warps2),
        sm90.compile_sm90(st._down_kernel, dict(down_pointers, out_ptr="*fp32"), down_ints, split, cfg.num_warps2),
    ]


@pytest.mark.parametrize("quant", list(_QUANTS), ids=["bf16", "fp8_channel", "fp8_block"])
def test_default_tiles_compile_for_sm90_with_wide_loads_and_no_spills(quant):
    """The interpreter runs what the GPU compiler may still refuse: both launches compiled for the H200 (ptxas ships
    with Triton), in a process of their own since this one's kernels are interpreted."""
    for ptx, report in sm90.reports("test_moe_small_t", f"_sm90_reports({quant})"):
        assert "ld.global.v4" in ptx and " 0 bytes spill stores" in report, report
