"""W4A16 / W8A16 weight-only GEMM: the checkpoint repacks, the reference and the Triton kernel (interpreted on CPU).

Every expectation is built here from integer values, independently of the module: the checkpoint tensors are
packed by the helpers below (bit by bit, with numpy), the expected weight `W[n, k] = s * (v - z)` and the product
are computed in float64 from the generated values, scales and zero points. The bit layouts are pinned by
hand-written words. Shapes are small and uneven (N = 40 or 48 against BLOCK_N = 32; M = 17 against BLOCK_M = 16)
and the kernel configs small, so the interpreter stays quick.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from spies import record_calls

from kestrel import ops
from kestrel.kernels import common, nibbles, wna16_dequant, wna16_gemv, wna16_tc
from kestrel.kernels import wna16 as wq
from kestrel.kernels.wna16 import WNA16Config

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
# bitsandbytes' 4-bit code books as it builds them: float32 tables divided by their largest magnitude.
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], dtype=np.float32)
FP4_BNB = np.array([0, 0.0625, 8, 12, 4, 6, 2, 3, -0.0, -0.0625, -8, -12, -4, -6, -2, -3], dtype=np.float32) / 12
CODE_BOOKS = {"nf4": NF4, "fp4_bnb": FP4_BNB}
VARIANTS = ["int4", "uint4", "fp4_e2m1", "nf4", "fp4_bnb", "int8", "int8_zp", "fp8_e4m3", "int4_mins", "int8_mins"]
GROUPS = [32, 64, 128, None]  # None: per channel
RTOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}
ACC_TOL = 1e-5  # fp32 accumulation, relative to sum |x| |w|


def as_i32(words) -> torch.Tensor:
    """Unsigned 32-bit words written in hex -> the int32 tensor a checkpoint stores."""
    return torch.from_numpy(np.array(words, dtype=np.uint64).astype(np.uint32).view(np.int32))


# ------------------------------------------------------------------------------------ test-side packers


def pack(a: np.ndarray, bits: int, axis: int, order=None) -> torch.Tensor:
    """Unsigned values -> int32 words along `axis`: element pf*j + order[i] at bits bits*i of word j."""
    pf = 32 // bits
    order = list(order) if order is not None else list(range(pf))
    a = np.moveaxis(np.asarray(a, dtype=np.uint64), axis, -1)
    a = a.reshape(*a.shape[:-1], a.shape[-1] // pf, pf)
    words = np.zeros(a.shape[:-1], dtype=np.uint64)
    for i in range(pf):
        words |= a[..., order[i]] << np.uint64(bits * i)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(words.astype(np.uint32).view(np.int32), -1, axis)))


def pack_fp4_bytes(codes: np.ndarray) -> torch.Tensor:
    """[N, K] codes -> uint8 [N, K // 2], element 2j in the low nibble."""
    return torch.from_numpy((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8))


# -------------------------------------------------------------------------------------- test weights


def make_weight(variant: str, group: int | None, act_order: bool, N: int, K: int, scale_dtype: torch.dtype,
                seed: int):
    """(WNA16Weight, W float64 [N, K]) for a variant, built through a checkpoint layout where one exists:
    int4: GPTQ sym (act-order) / compressed-tensors sym; uint4: GPTQ asym v1 (act-order) / AWQ; fp4: two per
    byte; int8: GPTQ 8-bit sym / compressed-tensors 8-bit; int8 with zeros: GPTQ 8-bit asym v2 / compressed-tensors
    8-bit asym; nf4 / fp4_bnb (bitsandbytes' code books): codes through `pack_wna16`; fp8: `pack_wna16`; int4 /
    int8 with float offsets (`*_mins`, w = s * v - m as llama.cpp's K-quants store it): `pack_wna16`."""
    rng = np.random.default_rng(seed)
    group = group or K
    G = K // group
    g_idx = rng.permutation(K) // group if act_order else np.arange(K) // group
    scales = (torch.rand(N, G, generator=torch.Generator().manual_seed(seed)) * 0.02 + 0.004).to(scale_dtype)
    s64 = scales.double().numpy()
    gi = torch.from_numpy(g_idx).to(torch.int32)
    zeros = None
    if variant in ("int4", "uint4", "fp4_e2m1", "nf4", "fp4_bnb", "int4_mins"):
        codes = rng.integers(0, 16, (N, K))
    elif variant == "fp8_e4m3":
        f8 = (torch.randn(N, K, generator=torch.Generator().manual_seed(seed + 1)) * 40).to(torch.float8_e4m3fn)
        codes = None
    else:
        codes = rng.integers(0, 256, (N, K))  # GPTQ's unsigned 8-bit codes; value = code - 128
    if variant == "int4":
        vals = codes - 8
        if act_order:
            w = wq.repack_gptq(pack(codes.T, 4, 0), scales.T.contiguous(), pack(np.full((G, N), 7), 4, 1), gi)
        else:
            w = wq.repack_compressed_tensors(pack(codes, 4, 1), scales)
    elif variant == "uint4":
        zeros = rng.integers(0, 16, (N, G))
        vals = codes - zeros[:, g_idx]
        if act_order:
            stored = (zeros.T - 1) & 15  # GPTQ v1 stores zero - 1 (0 wraps to 15)
            w = wq.repack_gptq(pack(codes.T, 4, 0), scales.T.contiguous(), pack(stored, 4, 1), gi, sym=False)
        else:
            w = wq.repack_awq(pack(codes.T, 4, 1, wq.AWQ_ORDER), pack(zeros.T, 4, 1, wq.AWQ_ORDER),
                              scales.T.contiguous())
    elif variant == "fp4_e2m1":
        vals = 2 * np.array(E2M1)[codes]  # twice the value: integers, exact
        s64 = s64 / 2
        w = wq.repack_fp4(pack_fp4_bytes(codes), scales, gi if act_order else None)
    elif variant in CODE_BOOKS:
        vals = CODE_BOOKS[variant].astype(np.float64)[codes]
        w = wq.pack_wna16(torch.from_numpy(codes), scales, g_idx=gi if act_order else None, weight_type=variant)
    elif variant == "int8":
        vals = codes - 128
        if act_order:
            w = wq.repack_gptq(pack(codes.T, 8, 0), scales.T.contiguous(), None, gi, bits=8)
        else:
            w = wq.repack_compressed_tensors(pack(codes, 8, 1), scales, num_bits=8)
    elif variant == "int8_zp":
        zeros = rng.integers(0, 256, (N, G))
        vals = codes - zeros[:, g_idx]
        if act_order:
            w = wq.repack_gptq(pack(codes.T, 8, 0), scales.T.contiguous(), pack(zeros.T, 8, 1), gi, bits=8,
                               sym=False, zeros_minus_one=False)
        else:
            w = wq.repack_compressed_tensors(pack(codes, 8, 1), scales, pack(zeros, 8, 0), num_bits=8)
    elif variant.endswith("_mins"):
        # Offsets of either sign, up to ten steps, and not multiples of the scale.
        mins = torch.from_numpy(rng.uniform(-10, 10, (N, G)).astype(np.float32)) * scales.float()
        vals = codes - 8 if variant == "int4_mins" else codes - 128
        w = wq.pack_wna16(torch.from_numpy(vals), scales, mins, gi if act_order else None,
                          weight_type=variant.removesuffix("_mins"))
        return w, vals * s64[:, g_idx] - mins.double().numpy()[:, g_idx]
    else:
        vals = f8.double().numpy()
        w = wq.pack_wna16(f8, scales, g_idx=gi if act_order else None, weight_type="fp8_e4m3")
    return w, vals * s64[:, g_idx]


def make_x(M: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_matches(out: torch.Tensor, x: torch.Tensor, W: np.ndarray, out_dtype: torch.dtype, bias=None,
                   w_rounding: float = 0.0) -> None:
    """`w_rounding`: the relative error of weights that enter the dot rounded (nf4 in a 16-bit dot)."""
    x64 = x.double().numpy()
    exact = x64 @ W.T
    mag = np.abs(x64) @ np.abs(W).T
    if bias is not None:
        exact = exact + bias.double().numpy()
        mag = mag + np.abs(bias.double().numpy())
    assert out.dtype == out_dtype and tuple(out.shape) == exact.shape
    got = out.cpu().double().numpy()
    bad = np.abs(got - exact) > RTOL[out_dtype] * np.abs(exact) + (ACC_TOL + w_rounding) * mag
    assert not bad.any(), f"{bad.sum()} of {bad.size} off, first at {np.argwhere(bad)[0]}"


def to_device(w, device):
    return wq.WNA16Weight(*[t.to(device) if torch.is_tensor(t) else t for t in w])


def check_triton_case(variant: str, group: int | None, act_order: bool, M: int, N: int, K: int,
                      x_dtype: torch.dtype, seed: int, cfg: WNA16Config, device: torch.device,
                      scale_dtype: torch.dtype | None = None, fma_path: bool = False) -> None:
    """`wna16_gemm` under `cfg` on a random weight (scales in `scale_dtype`, default x's) and M activation rows
    against the float64 oracle. nf4's code values are not exact in 16 bits: a compiled 16-bit dot takes them
    rounded to x's dtype, the fp32 FMA path (`fma_path`, block_m = 1) exactly."""
    w, W = make_weight(variant, group, act_order, N, K, scale_dtype or x_dtype, seed=seed)
    x = make_x(M, K, x_dtype, seed=M)
    out = wq.wna16_gemm(x.to(device), *to_device(w, device), x_dtype, config=cfg)
    rounded = not fma_path and variant == "nf4" and device.type == "cuda" and x_dtype != torch.float32
    assert_matches(out, x, W, x_dtype, w_rounding=2.0**-9 if rounded else 0.0)


def shape_of(group: int | None) -> tuple[int, int]:
    """(N, K): K = 128 holds 4 groups of 32 and 2 of 64; K = 256, 2 groups of 128; per channel K = 192."""
    return (48, 128) if group in (32, 64) else (40, 256) if group == 128 else (48, 192)


# --------------------------------------------------------------------------------------- GEMM: reference

CASES = [(v, g) for v in VARIANTS for g in GROUPS]


@pytest.mark.parametrize("variant,group", CASES)
def test_reference_matches_float64_oracle(variant, group):
    N, K = shape_of(group)
    for act_order in (False, True):
        for x_dtype in (torch.bfloat16, torch.float32):
            w, W = make_weight(variant, group, act_order, N, K, x_dtype, seed=hash((variant, group)) % 1000)
            assert (w.perm is not None) == (act_order and group is not None)
            for M in (1, 3, 17):
                x = make_x(M, K, x_dtype, seed=M)
                assert_matches(wq.wna16_gemm_ref(x, *w, x_dtype), x, W, x_dtype)


# ------------------------------------------------------------------------------------------ GEMM: Triton

# (act_order, M, x dtype, split_k): every pair of values of any two factors appears.
COMBOS = [
    (False, 1, torch.bfloat16, 1), (True, 1, torch.float32, 3),
    (False, 3, torch.float32, 3), (True, 3, torch.bfloat16, 1),
    (False, 17, torch.bfloat16, 3), (True, 17, torch.float32, 1),
]


@pytest.mark.parametrize("variant,group", CASES)
def test_triton_matches_float64_oracle(variant, group, device):
    N, K = shape_of(group)
    for i, (act_order, M, x_dtype, split_k) in enumerate(COMBOS):
        # fp16 scales with bf16 activations (GPTQ / AWQ checkpoints store fp16) in every other case.
        scale_dtype = torch.float16 if x_dtype == torch.bfloat16 and i % 2 else x_dtype
        cfg = WNA16Config(block_m=16, block_n=32, block_k=64, split_k=split_k)
        check_triton_case(variant, group, act_order, M, N, K, x_dtype, i, cfg, device, scale_dtype=scale_dtype)


FOUR_BIT = [v for v in VARIANTS if v not in ("int8", "int8_zp", "fp8_e4m3", "int8_mins")]


@pytest.mark.parametrize("variant", FOUR_BIT)
def test_nibble_dots_match_float64_oracle(variant, device):
    """The eight-dots-per-step path of the 4-bit types (block_k 128, group 128 and per channel of K = 256)."""
    N, K = 40, 256
    for i, (group, act_order, M, split_k) in enumerate([(128, False, 1, 2), (128, True, 17, 1), (None, False, 3, 1)]):
        x_dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        cfg = WNA16Config(block_m=16, block_n=32, block_k=128, split_k=split_k, nibble_dots=True)
        check_triton_case(variant, group, act_order, M, N, K, x_dtype, 10 + i, cfg, device)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gemv_path_matches_float64_oracle(variant, device):
    """block_m = 1: one activation row per program on the FMA units, grouped, per channel and act-order, split-K."""
    N, K = 40, 256
    for i, (group, act_order, M, split_k) in enumerate([(128, False, 1, 2), (64, True, 3, 1), (None, False, 2, 3)]):
        x_dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        cfg = WNA16Config(block_m=1, block_n=32, block_k=64, split_k=split_k, group_m=1)
        check_triton_case(variant, group, act_order, M, N, K, x_dtype, 20 + i, cfg, device, fma_path=True)


@pytest.mark.parametrize("variant", FOUR_BIT)
def test_swap_ab_and_fast_convert_match_float64_oracle(variant, device):
    """The nibble dots transposed (swap_ab: out^T = W^T x^T) and with fast_convert (int4 / uint4 with 16-bit
    activations take the PTX word-to-bf16 conversion when compiled, the portable one in the interpreter; other
    types and fp32 activations ignore the flag). Both are exact: the same tolerance as the other paths."""
    N, K = 40, 256
    cases = [(128, False, 1, 2, True, True), (128, True, 17, 1, True, False), (None, False, 3, 1, False, True),
             (128, False, 5, 3, True, False)]
    for i, (group, act_order, M, split_k, swap, fast) in enumerate(cases):
        x_dtype = torch.bfloat16 if i != 1 else torch.float32
        cfg = WNA16Config(block_m=16, block_n=32, block_k=128, split_k=split_k, nibble_dots=True, swap_ab=swap,
                          fast_convert=fast)
        check_triton_case(variant, group, act_order, M, N, K, x_dtype, 30 + i, cfg, device)


@pytest.mark.parametrize("variant", VARIANTS)
def test_swap_ab_one_dot_matches_float64_oracle(variant, device):
    """swap_ab without nibble dots: one dot per K step over the transposed tile, every weight type (fast_convert
    interleaves the PTX outputs back into K order for int4 / uint4 when compiled)."""
    N, K = 40, 256
    for i, (group, act_order, M, split_k, block_k) in enumerate([(128, False, 1, 2, 128), (64, True, 17, 1, 64),
                                                                 (None, False, 3, 3, 64)]):
        x_dtype = torch.bfloat16 if i != 1 else torch.float32
        cfg = WNA16Config(block_m=16, block_n=32, block_k=block_k, split_k=split_k, swap_ab=True, fast_convert=True)
        check_triton_case(variant, group, act_order, M, N, K, x_dtype, 50 + i, cfg, device)


@pytest.mark.parametrize("variant", ["int4", "uint4"])
def test_prescaled_tiles_match_float64_oracle(variant, device, monkeypatch):
    """`prescale` (`wna16_tc`): the weight formed as s * (c - z) in x's 16-bit dtype (the scale rounded to it,
    then the product: at most 2^-8 of each weight, relative) and one accumulator through every dot; both operand
    sides, one dot over the natural-order tile and eight nibble dots over x's permuted columns, groups of 128 and
    per channel, act-order (x sorted first), split K, a bias, fp16 rows and fp32 outputs."""
    taken = record_calls(monkeypatch, wna16_tc, "tc_gemm")
    N, K = 40, 256
    cases = [(128, False, 3, torch.bfloat16, 1, True, False, False),
             (128, True, 17, torch.bfloat16, 2, False, True, True),
             (None, False, 40, torch.float16, 1, True, True, False),
             (128, False, 33, torch.float16, 3, False, False, True),
             (None, True, 5, torch.bfloat16, 2, True, False, True)]
    for i, (group, act_order, M, x_dtype, split_k, swap, nibble_dots, bias) in enumerate(cases):
        w, W = make_weight(variant, group, act_order, N, K, torch.float16, seed=70 + i)
        x = make_x(M, K, x_dtype, seed=M)
        b = torch.randn(N, generator=torch.Generator().manual_seed(i)).to(x_dtype) if bias else None
        cfg = WNA16Config(block_m=16, block_n=32, block_k=128, split_k=split_k, swap_ab=swap, nibble_dots=nibble_dots,
                          prescale=True)
        out_dtype = torch.float32 if i == 1 else x_dtype
        out = wq.wna16_gemm(x.to(device), *to_device(w, device), out_dtype, b.to(device) if bias else None,
                            config=cfg)
        assert_matches(out, x, W, out_dtype, bias=b, w_rounding=2.0**-8)
    assert len(taken) == len(cases)


def test_prescaled_tiles_refuse_what_they_cannot_take(device, monkeypatch):
    """Groups under 128, float offsets, fp32 rows, one row, a block_k under 128, or more than MAX_SWAP_ROWS rows
    as the second operand: the looped tiles (exact operands) run instead, with the same results."""
    taken = record_calls(monkeypatch, wna16_tc, "tc_gemm")
    for variant, group, M, x_dtype, block_m, block_k in (("int4", 64, 5, torch.bfloat16, 16, 128),
                                                         ("int4_mins", 128, 5, torch.bfloat16, 16, 128),
                                                         ("uint4", 128, 5, torch.float32, 16, 128),
                                                         ("int4", 128, 1, torch.bfloat16, 1, 128),
                                                         ("int4", 128, 5, torch.bfloat16, 16, 64),
                                                         ("int4", 128, 5, torch.bfloat16, 256, 128)):
        w, W = make_weight(variant, group, False, 40, 256, x_dtype, seed=80)
        x = make_x(M, 256, x_dtype, seed=M)
        cfg = WNA16Config(block_m=block_m, block_n=32, block_k=block_k, prescale=True, swap_ab=block_m == 256)
        assert_matches(wq.wna16_gemm(x.to(device), *to_device(w, device), x_dtype, config=cfg), x, W, x_dtype)
    assert taken == []


def _prescaled_sm90_reports() -> list[tuple[str, str]]:
    """The prescaled tiles as a GPU compiles them, in the H200 table's forms: one dot per step with the weights as
    the first operand at 16, 64 and 128 rows (uint4 zeros at 128), split K."""
    import sm90

    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "bias_ptr": "*bf16",
                "out_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32"}
    ints = ["M", "N", "k_tiles", "k_tiles_per_split", "split_k", "steps_per_group", "stride_xm", "stride_wk",
            "stride_sg", "stride_zg", "stride_om"]
    aligned = frozenset(["z_ptr", "bias_ptr", "ws_ptr", "stride_wk", "stride_sg", "stride_zg"])
    reports = []
    for block_m, block_n, warps, stages, zeros in ((16, 128, 8, 4, False), (16, 64, 4, 4, False),
                                                   (64, 128, 8, 4, False), (128, 128, 8, 3, True)):
        flags = dict(HAS_ZEROS=zeros, HAS_BIAS=False, SPLIT=True, SWAP=True, ASM=True, DOT_F32=False, FAST=True,
                     NIBBLE_DOTS=False, STAGES=stages, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=1)
        reports.append(sm90.compile_sm90(wna16_tc._tc_kernel, pointers, ints, flags, warps, aligned=aligned))
    return reports


def test_prescaled_tiles_compile_for_sm90_on_the_tensor_cores_without_spills():
    """What the interpreter cannot show: the table's prescaled forms compile for the H200 to wgmma with the word
    conversion's lop3 and paired fma, their weight loads asynchronous copies, and no spills."""
    import sm90

    for ptx, report in sm90.reports("test_wna16", "_prescaled_sm90_reports()"):
        assert " 0 bytes spill stores" in report, report
        assert "wgmma.mma_async" in ptx and "cp.async" in ptx
        assert "lop3.b32" in ptx and "fma.rn.bf16x2" in ptx


def test_dense_config_writes_the_weight_out(device, monkeypatch):
    """A table entry with `dense` (groups of 128 too) takes the dense path where it applies (x's dtype out,
    act-order included) and the tiles elsewhere."""
    dense = record_calls(monkeypatch, wna16_dequant, "dequantize_kn")
    cfg = WNA16Config(block_m=16, block_n=32, block_k=128, dense=True)
    for variant, act_order, out_dtype in (("int4", False, torch.bfloat16), ("uint4", False, torch.bfloat16),
                                          ("int4", True, torch.bfloat16), ("int4", False, torch.float32),
                                          ("fp8_e4m3", False, torch.bfloat16)):
        w, W = make_weight(variant, 128, act_order, 40, 256, torch.bfloat16, seed=90)
        x = make_x(5, 256, torch.bfloat16, seed=5)
        out = wq.wna16_gemm(x.to(device), *to_device(w, device), out_dtype, config=cfg)
        assert_matches(out, x, W, out_dtype, w_rounding=2.0**-9)
    assert len(dense) == 4


def test_nibble_order_puts_each_nibble_run_together():
    order = wna16_tc.nibble_order(torch.arange(512).view(2, 256), 128)[1] - 256
    assert order[:4].tolist() == [0, 8, 16, 24] and order[16:18].tolist() == [1, 9] and order[128].item() == 128
    assert sorted(order.tolist()) == list(range(256))


@pytest.mark.parametrize("variant", ["int4", "uint4", "fp4_e2m1", "int8", "int4_mins"])
def test_fma_pipelines_match_float64_oracle(variant, device):
    """block_m = 1 with the next step's words prefetched into registers (1) or the loop pipelined by Triton (2);
    8-bit types ignore the field."""
    N, K = 40, 256
    for i, (pipe, group, act_order, M, split_k) in enumerate([(1, 64, False, 1, 2), (2, 64, True, 2, 1),
                                                              (1, None, False, 1, 3), (2, 128, False, 3, 2)]):
        x_dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        cfg = WNA16Config(block_m=1, block_n=32, block_k=64, split_k=split_k, group_m=1, fma_pipeline=pipe)
        check_triton_case(variant, group, act_order, M, N, K, x_dtype, 40 + i, cfg, device, fma_path=True)


@pytest.mark.parametrize("variant", ["int4_mins", "int8_mins"])
def test_mins_in_groups_of_16_on_every_path(variant, device, oneshot_calls):
    """Float offsets in groups of 16 (GGUF's Q6_K / Q3_K / Q2_K, and Q4_K_M's merged qkv): the tensor-core tiles
    (split over K, act-order), swap_ab with fast_convert, the FMA path and, for int4, the one-shot GEMV."""
    N, K = 48, 192
    cases = [(WNA16Config(block_m=16, block_n=32, block_k=64, split_k=2), False, 17, False),
             (WNA16Config(block_m=16, block_n=32, block_k=64, split_k=1), True, 5, False),
             (WNA16Config(block_m=16, block_n=32, block_k=64, swap_ab=True, fast_convert=True), False, 3, False),
             (WNA16Config(block_m=1, block_n=32, block_k=64, split_k=3, group_m=1), False, 2, True),
             (WNA16Config(block_m=1, block_n=32, block_k=64, num_warps=2, oneshot=True), True, 1, True)]
    for i, (cfg, act_order, M, fma_path) in enumerate(cases):
        x_dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        check_triton_case(variant, 16, act_order, M, N, K, x_dtype, 90 + i, cfg, device, fma_path=fma_path)
    assert len(oneshot_calls) == 1


@pytest.fixture
def oneshot_calls(monkeypatch):
    """The launches of the one-shot kernel, so a test knows the config took it (the FMA path would give the same
    numbers)."""
    return record_calls(monkeypatch, wna16_gemv, "w4_gemv")


@pytest.mark.parametrize("variant", ["int4", "uint4", "int4_mins"])
def test_oneshot_gemv_matches_float64_oracle(variant, device, oneshot_calls):
    """The one-shot decode GEMV (`oneshot`, block_m = 1): slices inside one group (split over K), holding several
    (summed per group before their scales), the whole of K (no split), per channel, act-order, fp32 and bf16 rows,
    M past MAX_ROWS (chunked), N a multiple of block_n (contiguous column loads) or not (wrapped columns)."""
    cases = [(128, False, 1, 64, 40), (32, True, 3, 128, 64), (None, False, 5, 64, 40),
             (64, False, wna16_gemv.MAX_ROWS + 1, 256, 64), (128, True, 2, 512, 40)]
    for i, (group, act_order, M, block_k, N) in enumerate(cases):
        x_dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        cfg = WNA16Config(block_m=1, block_n=32, block_k=block_k, num_warps=2, oneshot=True)
        check_triton_case(variant, group, act_order, M, N, 256, x_dtype, 60 + i, cfg, device, fma_path=True)
    assert len(oneshot_calls) == len(cases)


@pytest.mark.parametrize("variant", ["int8", "int8_mins"])
def test_oneshot_gemv_takes_int8_in_small_groups(variant, device, oneshot_calls, monkeypatch):
    """int8 values in groups of 16 or 32 (GGUF's Q6_K, Q8_0, Q5_K forms) take the one-shot GEMV: one row in its own
    slices (`int8_layout`, here scaled down to the test's shapes: a step inside one group or spanning several,
    several steps a program, split over K or not, N not a multiple of the block), more rows in half the configured
    ones (act-order, M past MAX_ROWS); in larger groups they keep the FMA path."""
    monkeypatch.setattr(wna16_gemv, "INT8_WARP_COLUMNS", 16)
    cfg = WNA16Config(block_m=1, block_n=32, block_k=64, num_warps=2, oneshot=True)
    # group, act-order, M, N, rows a step, fewest programs -> for one row: the steps a program and the K split
    cases = [(16, False, 1, 40, 32, 4, 4, 2), (32, True, 3, 64, 32, 4, None, None),
             (16, False, wna16_gemv.MAX_ROWS + 1, 48, 64, 4, None, None), (32, False, 1, 40, 16, 2, 8, 2),
             (16, False, 1, 64, 32, 1, 8, 1)]
    for i, (group, act_order, M, N, step_rows, programs, steps, split) in enumerate(cases):
        monkeypatch.setattr(wna16_gemv, "INT8_STEP_ROWS", step_rows)
        monkeypatch.setattr(wna16_gemv, "INT8_MIN_PROGRAMS", programs)
        if M == 1:
            _, _, block_k, got_steps = wna16_gemv.int8_layout(N, 256, group)
            assert (got_steps, 256 // (block_k * got_steps)) == (steps, split)
        x_dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        check_triton_case(variant, group, act_order, M, N, 256, x_dtype, 100 + i, cfg, device, fma_path=True)
    assert len(oneshot_calls) == len(cases)
    check_triton_case(variant, 64, False, 2, 40, 256, torch.float32, 105, cfg, device, fma_path=True)
    assert len(oneshot_calls) == len(cases)


def _gemv_sm90_reports() -> list[tuple[str, str]]:
    """The one-shot GEMV's layouts as a GPU compiles them: int8 in `int8_layout`'s slices (one and several steps,
    groups of 16 with offsets), int4 in groups of 32 with offsets under `w4_layout`'s grouped slices and under the
    configured ones (the H200 table's 512 rows x 128 columns, 4 warps)."""
    import sm90

    pointers = {"x_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*fp32", "z_ptr": "*fp32", "b_ptr": "*fp32",
                "out_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32"}
    ints = ["N", "group", "stride_xm", "stride_wk", "stride_sg", "stride_zg", "stride_om"]
    aligned = frozenset(["z_ptr", "b_ptr", "ws_ptr", "stride_wk", "stride_sg", "stride_zg"])
    common_flags = dict(ROWS=1, HAS_MINS=True, HAS_BIAS=False, USE_PDL=True, FAST=True, EVEN_N=True)
    reports = []
    for steps in (1, 8):
        warps = wna16_gemv.INT8_MAX_WARPS
        block_n, block_k = warps * wna16_gemv.INT8_WARP_COLUMNS, wna16_gemv.INT8_STEP_ROWS
        flags = dict(common_flags, SPLIT_K=32, GROUPS=1, BLOCK_N=block_n, BLOCK_K=block_k, STEPS=steps,
                     BYTE_PERMUTE=True)
        reports.append(sm90.compile_sm90(wna16_gemv._i8_gemv_kernel, pointers, ints, flags, warps, aligned=aligned))
    for block_n, block_k in ((4 * wna16_gemv.W4_WARP_COLUMNS, wna16_gemv.W4_GROUPED_ROWS), (128, 512)):
        flags = dict(common_flags, SPLIT_K=8, GROUPS=block_k // 32, HAS_ZEROS=False, BLOCK_N=block_n, BLOCK_K=block_k)
        reports.append(sm90.compile_sm90(wna16_gemv._w4_gemv_kernel, dict(pointers, w_ptr="*i32"), ints, flags, 4,
                                         aligned=aligned))
    return reports


def test_oneshot_gemv_layouts_compile_for_sm90_without_spills_or_shared_group_sums():
    """The interpreter runs what the GPU compiler may still refuse or spill: the int8 slices and the grouped int4
    slices compiled for the H200 (ptxas ships with Triton) load 16 bytes a thread, do not spill, and sum their
    groups in registers (a few shared-memory stores for the scales and the split-K tail, where the configured int4
    slices spanning 16 groups store each group's sums there); int8 turns bytes to fp32 by byte permutes."""
    import sm90

    (i8_one, i8_steps, w4_grouped, w4_configured) = sm90.reports("test_wna16", "_gemv_sm90_reports()")
    for ptx, report in (i8_one, i8_steps, w4_grouped):
        assert "ld.global.v4" in ptx and " 0 bytes spill stores" in report, report
        assert ptx.count("st.shared") <= 16
    assert ptx.count("st.shared") * 4 < w4_configured[0].count("st.shared")
    assert i8_one[0].count("prmt.b32") >= 256 and "cvt.rn.f32.s" not in i8_one[0]  # a byte permute a value


@pytest.mark.parametrize("variant", ["int4", "uint4", "int8", "int4_mins", "int8_mins", "fp8_e4m3"])
def test_prompt_rows_take_the_dense_path(variant, device, monkeypatch):
    """From DENSE_MIN_ROWS rows (scaled down here) in small groups the table's product writes the weight out dense
    and multiplies it there: groups of 16 and 32, a bias, fp32 and bf16 rows (the weight rounded once to bf16 with
    bf16 rows), act-order weights (written in their sorted order, x gathered); fewer rows and groups of 128 keep
    the tiles."""
    monkeypatch.setattr(wq, "DENSE_MIN_ROWS", 3)
    dense = record_calls(monkeypatch, wna16_dequant, "dequantize_kn")
    cases = [(16, False, 3, torch.bfloat16, True), (32, False, 5, torch.float32, False),
             (16, False, 2, torch.float32, False), (128, False, 5, torch.bfloat16, False),
             (32, True, 5, torch.bfloat16, False)]
    for i, (group, act_order, M, x_dtype, bias) in enumerate(cases):
        w, W = make_weight(variant, group, act_order, 48, 256, x_dtype, seed=200 + i)
        x = make_x(M, 256, x_dtype, seed=M)
        b = torch.randn(48, generator=torch.Generator().manual_seed(i)).to(x_dtype) if bias else None
        out = wq.wna16_gemm(x.to(device), *to_device(w, device), x_dtype, b.to(device) if bias else None)
        assert_matches(out, x, W, x_dtype, bias=b, w_rounding=2.0**-9 if x_dtype != torch.float32 else 0.0)
    assert len(dense) == 3
    for group in (16, 128):  # the dense weight itself: the reference's numbers, rounded once
        w, _ = make_weight(variant, group, False, 48, 256, torch.float32, seed=210 + group)
        ref = wq.dequantize_wna16(*w).T
        for dtype in (torch.float32, torch.bfloat16):
            wd = to_device(w, device)
            got = wna16_dequant.dequantize_kn(wd.qweight, wd.scales, wd.zeros, w.weight_type, group, dtype)
            assert got.shape == (256, 48) and got.dtype == dtype
            # s * v - m: a GPU contracts it into one FMA, one rounding fewer than the reference's; bit-equal else
            slack = 2.0**-23 * float(ref.abs().max()) if w.zeros is not None and w.zeros.is_floating_point() else 0.0
            torch.testing.assert_close(got.float().cpu(), ref.to(dtype).float(), rtol=0, atol=slack)


@pytest.mark.parametrize("variant", ["int4_mins", "int8_mins", "int4"])
def test_oneshot_gemv_with_its_layout_features_off(variant, device, oneshot_calls, monkeypatch):
    """What a GPU runs until its table turns "wna16_grouped_layout" / "wna16_int8_wide" on: the configured slices
    (several groups a slice summed across the threads), int8 in half the configured rows, converted by the
    conversion unit."""
    launch_feature = common.launch_feature
    monkeypatch.setattr(common, "launch_feature", lambda name, device: name not in (
        "wna16_grouped_layout", "wna16_int8_wide") and launch_feature(name, device))
    cfg = WNA16Config(block_m=1, block_n=32, block_k=128, num_warps=2, oneshot=True)
    cases = [(16, False, 1, 40), (32, True, 3, 64)] if variant != "int4" else [(32, False, 1, 64), (64, False, 2, 40)]
    for i, (group, act_order, M, N) in enumerate(cases):
        check_triton_case(variant, group, act_order, M, N, 256, torch.bfloat16, 120 + i, cfg, device, fma_path=True)
    assert len(oneshot_calls) == len(cases)


def test_oneshot_gemv_bias_determinism_and_other_types(device, oneshot_calls):
    """A bias and fp16 output, split over K and not; split-K replays bit-identical with the arrival counters left
    zeroed; weight types the one-shot kernel does not read (fp4, int8) keep the FMA path under the same config;
    block sizes that are no powers of two, and oneshot beside more than one row a program, are refused."""
    N, K = 40, 256
    w, W = make_weight("uint4", 64, False, N, K, torch.float16, seed=70)
    x = make_x(2, K, torch.float16, seed=71)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(72)).to(torch.float16)
    wd = to_device(w, device)
    for block_k in (32, K):
        cfg = WNA16Config(block_m=1, block_n=16, block_k=block_k, num_warps=1, oneshot=True)
        first = wq.wna16_gemm(x.to(device), *wd, torch.float16, bias.to(device), config=cfg)
        assert_matches(first, x, W, torch.float16, bias)
        again = wq.wna16_gemm(x.to(device), *wd, torch.float16, bias.to(device), config=cfg)
        assert torch.equal(first, again)
    assert int(common.arrival_counters(wd.qweight.device).abs().sum()) == 0
    assert len(oneshot_calls) == 4
    for variant in ("fp4_e2m1", "int8"):
        check_triton_case(variant, 64, False, 2, N, K, torch.float32, 73, cfg, device, fma_path=True)
    assert len(oneshot_calls) == 4
    assert [wna16_gemv.fit_block_k(bk, g, k) for bk, g, k in
            ((512, 128, 4096), (512, 4096, 4096), (512, 14336, 14336), (64, 128, 256), (256, 32, 96))] == \
        [512, 512, 512, 64, 32]
    for bad in (12, 4, 0):
        with pytest.raises(ValueError, match="block_k must be a power of two"):
            wq.wna16_gemm(x.to(device), *wd, torch.float16,
                          config=WNA16Config(block_m=1, block_n=16, block_k=bad, oneshot=True))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        wq.wna16_gemm(x.to(device), *wd, torch.float16, config=WNA16Config(block_m=1, block_n=24, block_k=32,
                                                                             oneshot=True))
    with pytest.raises(ValueError, match="needs block_m = 1"):
        WNA16Config(block_m=16, block_n=32, block_k=64, oneshot=True)


def test_nibble_asm_text():
    """The PTX of the word conversion: four lop3 into the magic number's mantissas, four paired fmas, each output
    register written once (nibble s in $s: bits 4s of the word, s < 4 from the low halves)."""
    for kind, magic, fma in (("bf16", "0x43004300", "fma.rn.bf16x2"), ("fp16", "0x64006400", "fma.rn.f16x2")):
        text = nibbles.nibble_asm(kind)
        assert text.count(f"0x000f000f, {magic}, 0xea;") == 4 and text.count(fma) == 4
        assert [f"${i}" in text for i in range(10)] == [True] * 10
        assert "mov.b32 {$0, $4}, t0;" in text and "mov.b32 {$3, $7}, t3;" in text
    # What the PTX computes, emulated on the bits: nibble pairs in magic mantissas minus (magic + z).
    word = 0x8F3A61C5
    for z in (8, 0, 15):
        got = []
        for s in range(4):
            pair = ((word >> (4 * s)) & 0x000F000F) | 0x43004300
            lo, hi = pair & 0xFFFF, pair >> 16
            base = 0x4300 | z
            got.append((lo - base, hi - base))  # bf16 with unit ulp: the mantissa difference is the value
        assert [g[0] for g in got] + [g[1] for g in got] == [((word >> (4 * s)) & 0xF) - z for s in range(8)]


def test_bias_fp16_output_and_default_config(device):
    """fp16 activations and output, a bias, the tuning table's config (auto split)."""
    N, K = 40, 256
    w, W = make_weight("uint4", 128, True, N, K, torch.float16, seed=7)
    x = make_x(5, K, torch.float16, seed=2)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for fn in (wq.wna16_gemm_ref, wq.wna16_gemm):
        out = fn(x.to(device), *to_device(w, device), torch.float16, bias.to(device))
        assert_matches(out, x, W, torch.float16, bias)


def test_split_k_is_deterministic_and_leaves_counters_zeroed(device):
    N, K = 48, 256
    w = to_device(make_weight("int4", 32, False, N, K, torch.bfloat16, seed=1)[0], device)
    x = make_x(3, K, torch.bfloat16, seed=1).to(device)
    cfg = WNA16Config(block_m=16, block_n=32, block_k=32, split_k=5)
    first = wq.wna16_gemm(x, *w, torch.bfloat16, config=cfg)
    assert int(common.arrival_counters(x.device).abs().sum()) == 0
    assert torch.equal(first, wq.wna16_gemm(x, *w, torch.bfloat16, config=cfg))


def test_strided_activations_and_empty_batch(device):
    N, K = 48, 128
    w, W = make_weight("fp8_e4m3", 64, False, N, K, torch.float32, seed=4)
    wide = make_x(3, K + 16, torch.float32, seed=5)
    x = wide[:, 8 : 8 + K]
    cfg = WNA16Config(block_m=16, block_n=32, block_k=64)
    assert_matches(wq.wna16_gemm(x.to(device), *to_device(w, device), torch.float32, config=cfg), x, W,
                   torch.float32)
    empty = wq.wna16_gemm(x[:0].to(device), *to_device(w, device), torch.bfloat16)
    assert empty.shape == (0, N)


def test_ops_reexports_the_repack_helpers():
    """The loaders' repack helpers are re-exported by ops (the same functions, up to the interpreter's reload).
    (`ops.wna16_gemm` on the CPU: `test_ops_on_the_cpu_take_the_c_path_unless_references_are_asked`.)"""
    w, _ = make_weight("int4", 64, True, 48, 128, torch.bfloat16, seed=9)
    again = ops.repack_gptq(w.qweight, w.scales)
    assert again.weight_type == "int4" and torch.equal(again.qweight, w.qweight)


@pytest.mark.parametrize(
    "bad",
    [
        dict(weight_type="int3"),
        dict(x_cols=96),  # K mismatch
        dict(scale_rows=3),  # 128 not a multiple of 3
        dict(scale_rows=16),  # group 8 < 16
        dict(weight_type="uint4"),  # uint4 without zeros
        dict(zeros=True),  # zeros with int4
        dict(zeros=torch.float32, weight_type="uint4"),  # float offsets beside uint4's own zero points
        dict(zeros=torch.float16),  # offsets must be float32
        dict(out_dtype=torch.int32),
        dict(x_dtype=torch.int8),
        dict(bias_n=7),
    ],
)
def test_invalid_arguments_raise(bad):
    qweight = torch.zeros(16, 48, dtype=torch.int32)  # K = 128
    scales = torch.ones(bad.get("scale_rows", 2), 48)
    zeros_dtype = bad.get("zeros")
    zeros = torch.zeros_like(scales, dtype=torch.int8 if zeros_dtype is True else zeros_dtype) if zeros_dtype else None
    x = torch.zeros(2, bad.get("x_cols", 128), dtype=bad.get("x_dtype", torch.bfloat16))
    bias = torch.zeros(bad["bias_n"]) if "bias_n" in bad else None
    for fn in (wq.wna16_gemm, wq.wna16_gemm_ref):
        with pytest.raises(ValueError):
            fn(x, qweight, scales, zeros, None, bad.get("weight_type", "int4"), bad.get("out_dtype", torch.bfloat16),
               bias)


# ------------------------------------------------------------------------------- repack: hand-built bits


def test_gptq_4bit_words_and_zeros_by_hand():
    """Word (j, n) of qweight holds rows 8j..8j+7 of column n at bits 4i; qzeros packs columns the same way."""
    qweight = torch.zeros(2, 8, dtype=torch.int32)  # K = 16, N = 8
    qweight[:, 0] = as_i32([0x87654321, 0xFEDCBA90])
    qweight[:, 3] = as_i32([0x0000000F, 0xF0000000])
    scales = torch.ones(1, 8, dtype=torch.float16)
    qzeros = as_i32([[0xF6543210]])  # v1: zero - 1 for columns 0..7; 0xF wraps to zero 0
    sym = wq.repack_gptq(qweight, scales, qzeros)
    assert sym.weight_type == "int4" and sym.zeros is None and torch.equal(sym.qweight, qweight)
    dense = wq.dequantize_wna16(*sym)
    assert dense[0].tolist() == [c - 8 for c in [1, 2, 3, 4, 5, 6, 7, 8, 0, 9, 10, 11, 12, 13, 14, 15]]
    assert dense[3].tolist() == [7] + [-8] * 14 + [7]
    assert dense[1].tolist() == [-8] * 16

    v1 = wq.repack_gptq(qweight, scales, qzeros, sym=False)
    assert v1.weight_type == "uint4" and v1.zeros.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]
    v2 = wq.repack_gptq(qweight, scales, qzeros, sym=False, zeros_minus_one=False)
    assert v2.zeros.tolist() == [[0, 1, 2, 3, 4, 5, 6, 15]]
    assert wq.dequantize_wna16(*v1)[3].tolist() == [11] + [-4] * 14 + [11]  # codes 15 and 0 minus zero 4


def test_gptq_8bit_words_by_hand():
    qweight = torch.zeros(4, 4, dtype=torch.int32)  # K = 16, N = 4
    qweight[0, 2] = as_i32([0x80FF017F])  # rows 0..3: codes 0x7F, 0x01, 0xFF, 0x80
    scales = torch.full((1, 4), 0.5, dtype=torch.float16)
    w = wq.repack_gptq(qweight, scales, None, bits=8)
    assert w.weight_type == "int8" and w.qweight.dtype == torch.int8
    assert w.qweight[:4, 2].tolist() == [-1, -127, 127, 0] and w.qweight[4:, 2].tolist() == [-128] * 12
    qzeros = as_i32([[0x00000000, 0x00000000, 0x00000000, 0x00000000]])  # [1, N // 4] ... only N // 4 = 1 used
    asym = wq.repack_gptq(qweight, scales, qzeros[:, :1], bits=8, sym=False)  # v1: every zero = 0 + 1
    assert asym.zeros.tolist() == [[1 - 128] * 4]
    assert wq.dequantize_wna16(*asym)[2, :4].tolist() == [0.5 * (c - 1) for c in (0x7F, 0x01, 0xFF, 0x80)]


def test_awq_interleaved_order_by_hand():
    """Nibble i of an AWQ word holds column 8j + [0, 2, 4, 6, 1, 3, 5, 7][i]."""
    qweight = torch.zeros(16, 1, dtype=torch.int32)  # K = 16, N = 8
    qweight[0, 0] = as_i32([0x76543210])  # nibble i holds i
    qzeros = as_i32([[0xFEDCBA98]])  # nibble i holds 8 + i
    w = wq.repack_awq(qweight, qzeros, torch.ones(1, 8, dtype=torch.float16))
    assert w.weight_type == "uint4"
    assert w.zeros.tolist() == [[8, 12, 9, 13, 10, 14, 11, 15]]
    codes_row0 = [0, 4, 1, 5, 2, 6, 3, 7]
    dense = wq.dequantize_wna16(*w)  # [N, K]
    assert dense[:, 0].tolist() == [c - z for c, z in zip(codes_row0, w.zeros[0].tolist())]
    assert dense[:, 1].tolist() == [-z for z in w.zeros[0].tolist()]


def test_compressed_tensors_words_by_hand():
    """Signed values + 8 packed along K in weight_packed [N, K // 8]; zero points packed along N."""
    packed = torch.zeros(2, 2, dtype=torch.int32)  # N = 2, K = 16
    packed[0] = as_i32([0x76543210, 0xFEDCBA98])  # stored k for k = 0..15: values k - 8
    packed[1] = as_i32([0x88888888, 0x8888888F])  # zeros, then value 7 at k = 8
    scale = torch.tensor([[1.0], [2.0]], dtype=torch.bfloat16)
    sym = wq.repack_compressed_tensors(packed, scale, weight_shape=torch.tensor([2, 16]))
    assert sym.weight_type == "int4"
    dense = wq.dequantize_wna16(*sym)
    assert dense[0].tolist() == [k - 8 for k in range(16)]
    assert dense[1].tolist() == [0.0] * 8 + [14.0] + [0.0] * 7
    zp_packed = as_i32([[0x000000A9]])  # [ceil(N / 8), G]: stored 9, 10 -> zero points 1, 2
    asym = wq.repack_compressed_tensors(packed, scale, zp_packed)
    zp_plain = wq.repack_compressed_tensors(packed, scale, torch.tensor([[1], [2]], dtype=torch.int8))
    assert asym.weight_type == "uint4" and asym.zeros.tolist() == [[9, 10]]
    assert torch.equal(asym.zeros, zp_plain.zeros)
    assert wq.dequantize_wna16(*asym)[0].tolist() == [k - 8 - 1 for k in range(16)]
    eight = torch.zeros(2, 4, dtype=torch.int32)  # 8-bit: N = 2, K = 16
    eight[1, 0] = as_i32([0xFF807F00])  # values -128, -1, 0, 127
    w8 = wq.repack_compressed_tensors(eight, scale, num_bits=8)
    assert w8.weight_type == "int8" and w8.qweight[:4, 1].tolist() == [-128, -1, 0, 127]


def test_compressed_tensors_packer_interop():
    """The layout compressed-tensors' own packer writes (when the library is installed)."""
    spec = importlib.util.find_spec("compressed_tensors")
    if spec is None:
        pytest.skip("compressed-tensors is not installed")
    # The helpers file alone (torch only): importing the package would pull in transformers, seconds of it.
    path = Path(spec.origin).parent / "compressors" / "pack_quantized" / "helpers.py"
    if not path.exists():
        pytest.skip(f"no {path} in this compressed-tensors version")
    helpers_spec = importlib.util.spec_from_file_location("_ct_pack_helpers", path)
    helpers = importlib.util.module_from_spec(helpers_spec)
    helpers_spec.loader.exec_module(helpers)
    rng = np.random.default_rng(0)
    for bits in (4, 8):
        lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
        q = torch.from_numpy(rng.integers(lo, hi, (24, 64))).to(torch.int8)
        zp = torch.from_numpy(rng.integers(lo, hi, (24, 2))).to(torch.int8)
        scale = (torch.rand(24, 2) + 0.5).to(torch.float16)  # 11-bit scales: s * (q - z) exact in fp32
        w = wq.repack_compressed_tensors(helpers.pack_to_int32(q, bits), scale,
                                         helpers.pack_to_int32(zp, bits, packed_dim=0), num_bits=bits)
        expected = (q.double() - zp.double().repeat_interleave(32, 1)) * scale.double().repeat_interleave(32, 1)
        assert torch.equal(wq.dequantize_wna16(*w).double(), expected)


def test_fp4_nibbles_by_hand():
    packed = torch.zeros(1, 8, dtype=torch.uint8)  # N = 1, K = 16
    packed[0, :3] = torch.tensor([0x71, 0xF8, 0x2A], dtype=torch.uint8)
    w = wq.repack_fp4(packed, torch.ones(1, 1, dtype=torch.bfloat16))
    assert w.weight_type == "fp4_e2m1"
    assert wq.dequantize_wna16(*w)[0, :6].tolist() == [0.5, 6.0, -0.0, -6.0, -1.0, 1.0]
    from_floats = wq.pack_wna16(torch.tensor([E2M1]), torch.ones(1, 1), weight_type="fp4_e2m1")
    assert wq.dequantize_wna16(*from_floats)[0].tolist() == E2M1
    with pytest.raises(ValueError):
        wq.pack_wna16(torch.full((1, 16), 2.5), torch.ones(1, 1), weight_type="fp4_e2m1")


def test_bitsandbytes_code_books_by_hand(device):
    """nf4 and fp4_bnb codes 0..15 with scale 1 give bitsandbytes' tables exactly (float32), in the kernel too."""
    codes = torch.arange(16, dtype=torch.int32).repeat(2).reshape(1, 32)  # K = 32, one group
    for weight_type, book in CODE_BOOKS.items():
        w = wq.pack_wna16(codes, torch.ones(1, 1), weight_type=weight_type)
        assert w.weight_type == weight_type
        assert wq.dequantize_wna16(*w)[0, :16].numpy().tolist() == book.tolist()
        x = torch.eye(32)  # row i picks weight column i
        out = wq.wna16_gemm(x.to(device), *to_device(w, device), torch.float32,
                            config=WNA16Config(block_m=16, block_n=16, block_k=32)).cpu()
        # fp4_bnb runs as integers m times 1 / 192 in float32: exact at these scales too.
        assert out[:16, 0].numpy().tolist() == book.tolist(), weight_type
    # bnb's fp4 is not e2m1: its codes 1..7 hold 1/192, 2/3, 1, 1/3, 1/2, 1/6, 1/4 of the block's absmax.
    assert FP4_BNB[:8].tolist() != (np.array(E2M1[:8]) / 6).astype(np.float32).tolist()


def test_act_order_sorts_rows_by_group():
    K, group = 32, 16
    g_idx = torch.tensor([1, 0] * 16, dtype=torch.int32)  # odd rows group 0, even rows group 1
    values = torch.arange(K).remainder(16).reshape(1, K) - 8
    w = wq.pack_wna16(values, torch.tensor([[1.0, 10.0]]), g_idx=g_idx, weight_type="int4")
    assert w.perm.tolist() == list(range(1, K, 2)) + list(range(0, K, 2))
    assert wq.dequantize_wna16(*w)[0].tolist() == [(k % 16 - 8) * (10.0 if k % 2 == 0 else 1.0) for k in range(K)]
    trivial = wq.pack_wna16(values, torch.tensor([[1.0, 10.0]]), g_idx=torch.arange(K) // group, weight_type="int4")
    assert trivial.perm is None
    with pytest.raises(ValueError):  # groups of unequal size
        wq.pack_wna16(values, torch.tensor([[1.0, 1.0]]), g_idx=torch.tensor([0] * 20 + [1] * 12), weight_type="int4")


# ----------------------------------------------------------------------------- repack: random round trips


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("act_order", [False, True])
def test_repack_round_trip_is_exact(variant, act_order):
    """Checkpoint tensors packed bit by bit here -> repack -> dequantize gives s * (v - z) exactly (fp16 scales:
    every product is exact in fp32)."""
    for group in GROUPS:
        N, K = shape_of(group)
        w, W = make_weight(variant, group, act_order, N, K, torch.float16, seed=3)
        assert w.weight_type == variant.removesuffix("_zp").removesuffix("_mins")
        # Code values times fp16 scales, or s * v less a float32 offset: one float32 rounding.
        if variant in CODE_BOOKS or variant.endswith("_mins"):
            assert np.allclose(wq.dequantize_wna16(*w).double().numpy(), W, rtol=2.0**-24, atol=0)
        else:
            assert torch.equal(wq.dequantize_wna16(*w).double(), torch.from_numpy(W))


# ------------------------------------------------------------------------------------- tuning table


def test_default_table_parses_and_buckets():
    table = wq.load_table(wq.DEFAULT_TABLE)
    assert table
    for bucket, entry in table.items():
        cfg = wq.WNA16Config.from_json(entry)
        assert int(bucket) >= 1 and cfg.block_k >= 16 and cfg.split_k >= 0
    cfg1 = wq.select_config(4096, 4096, 1, torch.device("cpu"))
    assert cfg1 == wq.lookup(table, 16) and cfg1.split_k == 0
    assert wq.select_config(4096, 4096, 100000, torch.device("cpu")) == wq.lookup(table, 4096)
    assert wq.lookup({}, 3) is None


def test_gpu_table_entries_by_weight_type(monkeypatch):
    """A GPU table's plain "N,K" entries serve the weights the one-shot GEMV runs (int4 / uint4, int8 in small
    groups); another weight takes its own "N,K,TYPE" entries, else the default table (a 4-bit entry's one-shot tile
    spilled on 8-bit weights in groups of 128)."""
    oneshot = WNA16Config(1, 512, 128, 1, oneshot=True)
    fp8 = WNA16Config(16, 32, 128, 4, num_warps=4)
    table = {"64,256": {"1": oneshot.to_json()}, "64,256,fp8_e4m3": {"1": fp8.to_json()},
             "64,256,int8": {"1": oneshot.to_json()}}
    monkeypatch.setattr(wq.common, "gpu_table", lambda kernel, device: table if kernel == "wna16" else {})
    cpu = torch.device("cpu")
    assert wq.select_config(64, 256, 1, cpu, "int4") == wq.select_config(64, 256, 1, cpu, "uint4") == oneshot
    assert wq.select_config(64, 256, 1, cpu, "int8", group=32) == oneshot  # GGUF's Q8_0 / Q6_K: the GEMV runs it
    assert wq.select_config(64, 256, 1, cpu, "fp8_e4m3") == fp8
    for other in ("nf4", "fp4_e2m1", "fp4_bnb"):
        assert wq.select_config(64, 256, 1, cpu, other) == wq.default_config(1)
    # A one-shot entry for a weight the GEMV does not run (int8 in groups of 128): the default tiles instead,
    # still exact.
    fallback = record_calls(monkeypatch, wq, "default_config")
    w, W = make_weight("int8", 128, False, 64, 256, torch.bfloat16, seed=5)
    x = make_x(1, 256, torch.bfloat16, seed=6)
    assert_matches(wq.wna16_gemm(x, *w, torch.bfloat16), x, W, torch.bfloat16)
    assert fallback and fallback[0][0] == (1,)


def test_block_k_and_split_choices():
    assert [wq.fit_block_k(128, g) for g in (32, 64, 128, 192, 4096)] == [32, 64, 128, 64, 128]
    assert wq.split_for(3, tiles=10, k_tiles=2, num_sms=132) == 2
    assert wq.split_for(0, tiles=64, k_tiles=32, num_sms=132) == 4  # N = 4096 / 64 at M = 1, K = 4096
    assert wq.split_for(0, tiles=448, k_tiles=32, num_sms=132) == 1
    assert wq.split_for(0, tiles=64, k_tiles=2, num_sms=132) == 1


def test_kernels_really_run_in_the_interpreter():
    if torch.cuda.is_available():
        pytest.skip("compiled kernels on a GPU machine")
    assert type(wq._wna16_kernel).__name__ == "InterpretedFunction"


# ------------------------------------------------------------------------------------------ the CPU path


@pytest.fixture
def c_path_only(monkeypatch):
    """The C path or a failure: the reference it falls back to raises, and the library must have been built."""
    from kestrel.kernels.cpu import native
    from kestrel.kernels.cpu import wna16 as cpu_wna16

    if native.find_compiler() is None:
        pytest.skip("no C compiler")
    assert native.w4_gemv_fn() is not None and native.w4_dequant_fn() is not None, "wna16.c did not build"

    def no_reference(*args, **kwargs):
        raise AssertionError("the CPU path fell back to the reference")

    monkeypatch.setattr(cpu_wna16._wna16, "wna16_gemm_ref", no_reference)
    return cpu_wna16


def test_cpu_path_matches_float64_oracle(c_path_only, monkeypatch):
    """`kernels/cpu/wna16.py` (C): few rows (one pass over the words) and more (column chunks of the dequantized
    weight, made small here so several chunks, a full C block plus a remainder inside one, and a short last chunk
    run), int4 / uint4, grouped / per channel / act-order, N not a multiple of the C block, a bias, three activation
    dtypes; and a weight large enough for the C loops' parallel regions. int8 (plain, zero points, offsets) in
    torch column chunks at every row count."""
    cpu_wna16 = c_path_only
    monkeypatch.setattr(cpu_wna16, "CHUNK_COLUMNS", 80)
    cases = [("int4", 128, False, 100, 256), ("uint4", 32, True, 64, 128), ("int4", None, False, 100, 256),
             ("uint4", 64, False, 64, 128), ("int4", 128, False, 1024, 1024), ("int4_mins", 32, False, 64, 128),
             ("int8", None, False, 100, 256), ("int8_zp", 64, True, 64, 128), ("int8_mins", 16, False, 100, 192)]
    for i, (variant, group, act_order, N, K) in enumerate(cases):
        w, W = make_weight(variant, group, act_order, N, K, torch.float16 if i % 2 else torch.bfloat16, seed=80 + i)
        bias = torch.randn(N, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        rows = ((1, torch.bfloat16), (17, torch.float32)) if N == 1024 else (
            (1, torch.bfloat16), (3, torch.float32), (cpu_wna16.GEMV_ROWS + 1, torch.float16), (40, torch.bfloat16))
        for M, x_dtype in rows:
            x = make_x(M, K, x_dtype, seed=M)
            out = cpu_wna16.wna16_gemm_cpu(x, *w, x_dtype, bias if M == 3 else None)
            assert_matches(out, x, W, x_dtype, bias if M == 3 else None)


def test_ops_on_the_cpu_take_the_c_path_unless_references_are_asked(c_path_only, monkeypatch):
    """`ops.wna16_gemm` on CPU tensors runs the C path for int4 (the reference raises here), and the plain reference
    within `ops.cpu_references()`; other weight types take the reference inside the CPU wrapper."""
    from kestrel.kernels import wna16 as fresh_wq

    N, K = 48, 128
    w, W = make_weight("int4", 64, True, N, K, torch.bfloat16, seed=9)
    x = make_x(4, K, torch.bfloat16, seed=9)
    assert_matches(ops.wna16_gemm(x, *w, torch.bfloat16), x, W, torch.bfloat16)
    monkeypatch.undo()
    with ops.cpu_references():
        assert torch.equal(ops.wna16_gemm(x, *w, torch.bfloat16), fresh_wq.wna16_gemm_ref(x, *w, torch.bfloat16))
    w4, W4 = make_weight("fp4_e2m1", 64, False, N, K, torch.float32, seed=5)
    x4 = make_x(2, K, torch.float32, seed=6)
    assert torch.equal(ops.wna16_gemm(x4, *w4, torch.float32), fresh_wq.wna16_gemm_ref(x4, *w4, torch.float32))


def test_cpu_path_falls_back_for_gradients_and_weights_off_the_cpu(monkeypatch):
    """A weight whose scales need a gradient keeps the reference (its autograd graph), as does a weight on the meta
    device (the C code would read its pointers)."""
    from kestrel.kernels.cpu import wna16 as cpu_wna16

    calls = record_calls(monkeypatch, cpu_wna16._wna16, "wna16_gemm_ref")
    N, K = 48, 128
    w, W = make_weight("int4", 64, False, N, K, torch.float32, seed=11)
    scales = w.scales.clone().requires_grad_(True)
    x = make_x(2, K, torch.float32, seed=12)
    out = cpu_wna16.wna16_gemm_cpu(x, w.qweight, scales, w.zeros, w.perm, w.weight_type, torch.float32)
    out.sum().backward()
    assert scales.grad is not None and scales.grad.abs().sum() > 0
    cpu_wna16.wna16_gemm_cpu(x, w.qweight.to("meta"), w.scales.to("meta"), None, None, "int4", torch.float32)
    assert [args[5] for args, _ in calls] == ["int4", "int4"]
