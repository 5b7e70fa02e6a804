"""GPU-only: the W4A16 / W8A16 kernel at Llama-3-8B shapes against its reference (skipped without CUDA).

Run on the H200: `.venv/bin/python -m pytest -q tests/gpu/test_wna16_gpu.py`; `python tests/gpu/test_wna16_gpu.py
[--sweep]` times the default configs at the same shapes against torch.mm with BF16 weights (and, with --sweep, a
small config grid: the starting point of an H200 tuning table).

Both sides accumulate in fp32 from the same exact products (the kernel's bf16 operands are exact: x is bf16, the
weight operand is a small integer or an fp4 / fp8 value, the group scale is applied in fp32), so they differ only by
accumulation order: ~1e-6 relative before the single rounding, which may then land one bf16 unit apart.
"""

from __future__ import annotations

import argparse
import itertools

import pytest
import torch
from spies import record_calls

from kestrel.kernels import wna16 as wq
from kestrel.kernels.wna16 import WNA16Config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (N, K) of Llama-3-8B's linears: qkv, o, gate_up, down.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
TOKENS = [1, 16, 64, 256]
GROUP = 128
BF16_ULP = 2.0**-7  # one bf16 unit, relative


def make_weight(N: int, K: int, weight_type: str = "int4", group: int | None = GROUP, act_order: bool = False,
                seed: int = 0) -> wq.WNA16Weight:
    """Random values of the type, fp16 scales making the output O(1), built on the GPU through `pack_wna16`."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    group = group or K
    G = K // group
    dev = "cuda"
    if weight_type == "fp8_e4m3":
        values = (torch.randn(N, K, generator=g, device=dev) * 40).to(torch.float8_e4m3fn)
        mag = 40.0
    else:
        lo, hi = {"int4": (-8, 8), "uint4": (0, 16), "int8": (-128, 128)}.get(weight_type, (0, 16))  # 4-bit codes
        values = torch.randint(lo, hi, (N, K), generator=g, device=dev)
        mag = {"int4": 5.0, "uint4": 5.0, "fp4_e2m1": 3.0, "int8": 70.0, "nf4": 0.5, "fp4_bnb": 0.5}[weight_type]
    zeros = torch.randint(0, 16, (N, G), generator=g, device=dev) if weight_type == "uint4" else None
    scales = ((torch.rand(N, G, generator=g, device=dev) + 0.5) / (mag * K**0.5)).to(torch.float16)
    g_idx = torch.randperm(K, generator=g, device=dev) // group if act_order else None
    return wq.pack_wna16(values, scales, zeros, g_idx, weight_type=weight_type)


def make_x(M: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16)


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    diff = (out.float() - ref.float()).abs()
    bound = BF16_ULP * ref.float().abs() + 1e-3 * ref.float().abs().max()
    assert bool((diff <= bound).all()), f"max diff {diff.max().item():.3g}"
    assert (diff.norm() / ref.float().norm()).item() < 1e-3


@pytest.fixture
def rounded_paths(monkeypatch):
    """The calls of the paths that take the weight rounded to 16 bits (the prescaled tiles, the dense path) made
    while the test runs, one list each: where the table sends a product there (`any` of them),
    `assert_table_output` allows that rounding."""
    from kestrel.kernels import wna16_dequant, wna16_tc

    return record_calls(monkeypatch, wna16_tc, "tc_gemm"), record_calls(monkeypatch, wna16_dequant, "dequantize_kn")


def assert_table_output(out, x, w, bias, rounded: bool) -> None:
    """The table's product: exact operands (`assert_close` against the reference), or with the weight rounded
    (`assert_weight_rounded`)."""
    if not rounded:
        assert_close(out, wq.wna16_gemm_ref(x, *w, out.dtype, bias))
        return
    assert_weight_rounded(out, x, w, bias)


def assert_weight_rounded(out, x, w, bias=None, slack=0.0) -> None:
    """Each weight rounded to bf16 twice at most (its scale, then s * (c - z)), the output once, against the float64
    product ref (plus `bias`): |out - ref| <= 2^-8 (sum |x| |w| + |ref| + slack)."""
    dense = wq.dequantize_wna16(*w).double()
    ref = x.double() @ dense.T + (bias.double() if bias is not None else 0.0)
    bound = 2.0**-8 * (x.double().abs() @ dense.abs().T + ref.abs() + slack)
    diff = (out.double() - ref).abs()
    assert bool((diff <= bound).all()), f"max excess {(diff - bound).max().item():.3g}"


@pytest.fixture(autouse=True)
def _no_tf32():
    """The fp32 reference matmul must stay fp32."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def shape_weight(request):
    N, K = request.param
    w = make_weight(N, K)
    yield N, K, w
    del w
    torch.cuda.empty_cache()


# The forms a GGUF Q4_K_M file of the 8B shape runs (Q6_K merged beside Q4_K: int8 in groups of 16 with float
# offsets; Q6_K alone: int8 in groups of 16; Q4_K: int4 in groups of 32 with offsets), at one row (the one-shot
# GEMV in the table's layout features) and at a prompt's rows (the dense path, whose bf16 weight is rounded once).
GGUF_FORMS = [("int8", 16, True, 6144, 4096), ("int8", 16, False, 4096, 14336), ("int4", 32, True, 28672, 4096),
              ("int4", 32, True, 4096, 14336)]


@pytest.mark.parametrize("weight_type,group,mins,N,K", GGUF_FORMS)
@pytest.mark.parametrize("M", [1, 2, 128])
def test_gguf_forms_match_reference_8b_shapes(weight_type, group, mins, N, K, M):
    g = torch.Generator(device="cuda").manual_seed(N + K + M)
    lo, hi = (-32, 32) if weight_type == "int8" else (-8, 8)
    values = torch.randint(lo, hi, (N, K), generator=g, device="cuda")
    if weight_type == "int8":
        values = values.to(torch.int8)
    scales = (torch.rand(N, K // group, generator=g, device="cuda") + 0.5) / (20.0 * K**0.5)
    offsets = torch.rand(N, K // group, generator=g, device="cuda") / (20.0 * K**0.5) if mins else None
    w = wq.pack_wna16(values, scales, offsets, weight_type=weight_type)
    x = make_x(M, K, seed=M)
    out = wq.wna16_gemm(x, *w, torch.bfloat16)
    ref = wq.wna16_gemm_ref(x, *w, torch.bfloat16)
    if M >= wq.DENSE_MIN_ROWS:  # the weight entered the product rounded to bf16: one more rounding a weight
        diff = (out.float() - ref.float()).norm() / ref.float().norm()
        assert diff.item() < 4e-3, diff.item()
    else:
        assert_close(out, ref)


@pytest.mark.parametrize("M", TOKENS)
def test_kernel_matches_reference_8b_shapes(shape_weight, M, rounded_paths):
    N, K, w = shape_weight
    x = make_x(M, K, seed=M)
    out = wq.wna16_gemm(x, *w, torch.bfloat16)
    assert_table_output(out, x, w, None, any(rounded_paths))


@pytest.mark.parametrize("weight_type", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("M", [1, 16, 128, 1024])
def test_8bit_table_entries_match_float64_8b_shapes(shape_weight, weight_type, M, rounded_paths):
    """The "N,K,TYPE" entries of 8-bit weights in groups of 128 (block-FP8 layers run weight-only, W8A16), prompt
    rows included, where the dense path may take them."""
    N, K, _ = shape_weight
    w = make_weight(N, K, weight_type, seed=3)
    x = make_x(M, K, seed=M + 1)
    out = wq.wna16_gemm(x, *w, torch.bfloat16)
    assert_table_output(out, x, w, None, any(rounded_paths))


@pytest.mark.parametrize("weight_type", ["int4", "uint4", "fp4_e2m1", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("group,act_order", [(GROUP, False), (GROUP, True), (32, False), (None, False)])
@pytest.mark.parametrize("M", [1, 64])
def test_every_weight_type_compiles_and_matches(weight_type, group, act_order, M, rounded_paths):
    N, K = 4096, 4096
    w = make_weight(N, K, weight_type, group, act_order, seed=1)
    x = make_x(M, K, seed=2)
    bias = torch.randn(N, device="cuda").to(torch.bfloat16) if M == 64 else None
    out = wq.wna16_gemm(x, *w, torch.bfloat16, bias)
    assert_table_output(out, x, w, bias, any(rounded_paths))


@pytest.mark.parametrize("weight_type", ["int4", "uint4"])
@pytest.mark.parametrize("group,act_order", [(GROUP, False), (GROUP, True), (32, False), (None, False)])
@pytest.mark.parametrize("bn,bk,warps", [(128, 128, 4), (64, 512, 8), (32, 256, 2)])
def test_oneshot_gemv_compiles_and_matches(weight_type, group, act_order, bn, bk, warps):
    """The one-shot decode GEMV (`oneshot`), compiled: slices inside a group, holding several, per channel,
    act-order; one row, a few, and more than one launch holds (chunks of MAX_ROWS)."""
    N, K = 4096, 4096
    w = make_weight(N, K, weight_type, group, act_order, seed=11)
    cfg = WNA16Config(block_m=1, block_n=bn, block_k=bk, num_warps=warps, oneshot=True)
    for M in (1, 2, 5, 9):
        x = make_x(M, K, seed=12 + M)
        bias = torch.randn(N, device="cuda").to(torch.bfloat16) if M == 5 else None
        assert_close(wq.wna16_gemm(x, *w, torch.bfloat16, bias, config=cfg),
                     wq.wna16_gemm_ref(x, *w, torch.bfloat16, bias))


@pytest.mark.parametrize("weight_type", ["int4", "uint4"])
def test_oneshot_gemv_whole_k_wrapped_columns_and_bias(weight_type):
    """One slice holding all of K (no split), N not a multiple of block_n (wrapped columns), a bias."""
    N, K = 4096 + 16, 4096
    w = make_weight(N, K, weight_type, GROUP, seed=13)
    cfg = WNA16Config(block_m=1, block_n=64, block_k=K, num_warps=8, oneshot=True)
    for M in (1, 3):
        x = make_x(M, K, seed=14 + M)
        bias = torch.randn(N, device="cuda").to(torch.bfloat16)
        assert_close(wq.wna16_gemm(x, *w, torch.bfloat16, bias, config=cfg),
                     wq.wna16_gemm_ref(x, *w, torch.bfloat16, bias))


@pytest.mark.parametrize("weight_type", ["nf4", "fp4_bnb"])
@pytest.mark.parametrize("M", [1, 64])
def test_bitsandbytes_code_books(weight_type, M):
    """bitsandbytes' blocks of 64 as groups. fp4_bnb enters the dot exactly (integers / 192); nf4's code values enter
    a tensor-core dot rounded to bf16, as the module says: the reference here takes the code book rounded the same
    way. The FMA path (block_m 1, chosen for one row where the table says so) multiplies in fp32: exact."""
    N, K, group = 4096, 4096, 64
    w = make_weight(N, K, weight_type, group, seed=9)
    x = make_x(M, K, seed=10)
    out = wq.wna16_gemm(x, *w, torch.bfloat16)
    if weight_type == "fp4_bnb" or wq.select_config(N, K, M, x.device, weight_type, w.zeros, group).block_m == 1:
        assert_close(out, wq.wna16_gemm_ref(x, *w, torch.bfloat16))
        return
    book = torch.tensor(wq.NF4_VALUES, device="cuda").to(torch.bfloat16).float()
    codes = wq.unpack_values(w.qweight, weight_type).long()
    dense = book[codes] * w.scales.float().repeat_interleave(group, 0)  # [K, N]
    assert_close(out, (x.float() @ dense).to(torch.bfloat16))
    exact = wq.wna16_gemm_ref(x, *w, torch.bfloat16).float()
    assert ((out.float() - exact).norm() / exact.norm()).item() < 4e-3  # bf16 rounding of the code values


def test_fp16_and_fp32_activations():
    w = make_weight(4096, 4096, "uint4", act_order=True, seed=3)
    for dtype in (torch.float16, torch.float32):
        x = make_x(16, 4096, seed=4).to(dtype)
        out = wq.wna16_gemm(x, *w, dtype)
        ref = wq.wna16_gemm_ref(x, *w, dtype)
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-3


@pytest.mark.parametrize("M", [1, 16])
def test_cuda_graph_capture_with_act_order_and_split_k(M):
    """Captured once (the act-order gather and the split-K counters inside), replayed on new inputs: the eager
    output bit for bit (the split partials are summed in a fixed order)."""
    w = make_weight(4096, 4096, "int4", act_order=True, seed=5)
    cfg = WNA16Config(block_m=16, block_n=64, block_k=128, split_k=4)
    x = make_x(M, 4096, seed=6)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        wq.wna16_gemm(x, *w, torch.bfloat16, config=cfg)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = wq.wna16_gemm(x, *w, torch.bfloat16, config=cfg)
    for seed in (7, 8):
        x.copy_(make_x(M, 4096, seed=seed))
        graph.replay()
        assert torch.equal(static_out, wq.wna16_gemm(x, *w, torch.bfloat16, config=cfg))


# Every kernel variant (the WNA16Config switches) on the 8B shapes, against the float64 product.
VARIANT_CONFIGS = {
    "nibbles": WNA16Config(16, 64, 128, 0, 1, nibble_dots=True),
    "nibbles+fast": WNA16Config(16, 64, 256, 0, 1, nibble_dots=True, fast_convert=True),
    "swap": WNA16Config(16, 64, 128, 0, 1, nibble_dots=True, swap_ab=True),
    "swap+fast": WNA16Config(16, 128, 128, 0, 1, 8, 4, nibble_dots=True, swap_ab=True, fast_convert=True),
    "swap+fast-m64": WNA16Config(64, 128, 128, 0, 1, nibble_dots=True, swap_ab=True, fast_convert=True),
    "swap-one-dot": WNA16Config(16, 64, 128, 0, 1, swap_ab=True),
    "swap-one-dot+fast": WNA16Config(16, 128, 128, 0, 1, 8, 4, swap_ab=True, fast_convert=True),
    "fma-prefetch": WNA16Config(1, 256, 128, 0, 1, 4, 4, fma_pipeline=1),
    "fma-stages": WNA16Config(1, 128, 256, 0, 1, 4, 4, fma_pipeline=2),
}


def float64_product(x: torch.Tensor, w: wq.WNA16Weight) -> torch.Tensor:
    return x.double() @ wq.dequantize_wna16(*w).double().T


def assert_close_f64(out: torch.Tensor, ref: torch.Tensor) -> None:
    """One bf16 rounding (at most 2^-8 relative) of a value that differs from the float64 product by fp32
    summation order only; a wrong nibble order or zero point is off by O(1)."""
    diff = (out.double() - ref).abs()
    bound = BF16_ULP * ref.abs() + 1e-3 * ref.abs().max()
    assert bool((diff <= bound).all()), f"max diff {diff.max().item():.3g}"
    assert (diff.norm() / ref.norm()).item() < 5e-3


@pytest.mark.parametrize("name", list(VARIANT_CONFIGS))
@pytest.mark.parametrize("M", [1, 5, 16, 64])
def test_variants_match_float64_8b_shapes(shape_weight, name, M):
    N, K, w = shape_weight
    x = make_x(M, K, seed=100 + M)
    out = wq.wna16_gemm(x, *w, torch.bfloat16, config=VARIANT_CONFIGS[name])
    assert_close_f64(out, float64_product(x, w))


@pytest.mark.parametrize("weight_type", ["int4", "uint4"])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("swap,nibbles", [(False, True), (True, True), (True, False)])
def test_fast_convert_types_and_activation_dtypes(weight_type, x_dtype, swap, nibbles):
    """The PTX conversion's two magic numbers (bf16, fp16) with the int4 zero (8) and per-column uint4 zeros, an
    act-order gather and a bias; fp16 results compared at fp16's unit (2^-10)."""
    N, K = 4096, 4096
    w = make_weight(N, K, weight_type, act_order=weight_type == "uint4", seed=11)
    for M in (1, 16):
        x = make_x(M, K, seed=12 + M).to(x_dtype)
        bias = torch.randn(N, device="cuda").to(x_dtype)
        cfg = WNA16Config(16, 128, 128, 0, 1, nibble_dots=nibbles, swap_ab=swap, fast_convert=True)
        out = wq.wna16_gemm(x, *w, x_dtype, bias, config=cfg)
        ref = float64_product(x, w) + bias.double()
        diff = (out.double() - ref).abs()
        ulp = BF16_ULP if x_dtype == torch.bfloat16 else 2.0**-10
        assert bool((diff <= ulp * ref.abs() + 1e-3 * ref.abs().max()).all()), f"max diff {diff.max().item():.3g}"


# --------------------------------------------------------------------------------------------- timing


def _time_us(fn) -> float:
    """Median of replays of a CUDA graph of `fn` (launch overhead as the engine sees it under graphs)."""
    import triton

    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median") * 1e3


def _grid(M: int) -> list[WNA16Config]:
    """A small grid around the defaults (one config per line of a future tuning table)."""
    if M <= 16:
        space = itertools.product((16,), (32, 64, 128), (64, 128), (0, 1), ((4, 3), (4, 4)))
    elif M <= 64:
        space = itertools.product((16, 64), (64, 128), (64, 128), (0, 1), ((4, 4),))
    else:
        space = itertools.product((64, 128), (64, 128), (64, 128), (1,), ((4, 3), (8, 3)))
    return [WNA16Config(bm, bn, bk, split, 1 if M <= 64 else 8, warps, stages)
            for bm, bn, bk, split, (warps, stages) in space]


def bench(sweep: bool, weight_type: str = "int4") -> None:
    print(f"{weight_type} group {GROUP}: wna16 vs torch.mm BF16 (CUDA-graph replays, median)", flush=True)
    for N, K in SHAPES:
        w = make_weight(N, K, weight_type)
        dense = wq.dequantize_wna16(*w).to(torch.bfloat16)
        wbytes = sum(t.numel() * t.element_size() for t in w[:3] if t is not None)
        for M in TOKENS:
            x = make_x(M, K, seed=M)
            cfg = wq.select_config(N, K, M, x.device, weight_type, w.zeros, GROUP)
            us = _time_us(lambda: wq.wna16_gemm(x, *w, torch.bfloat16, config=cfg))  # noqa: B023
            mm = _time_us(lambda: torch.mm(x, dense.T))  # noqa: B023
            line = (f"N={N:5d} K={K:5d} M={M:3d}: wna16 {us:7.1f} us ({wbytes / us / 1e3:5.0f} GB/s), torch.mm bf16 "
                    f"{mm:7.1f} us, ratio wna16/mm {us / mm:4.2f}")
            if sweep:
                timed = []
                for c in _grid(M):
                    try:
                        timed.append((_time_us(lambda: wq.wna16_gemm(x, *w, torch.bfloat16, config=c)), c))  # noqa: B023
                    except Exception as exc:  # out of shared memory or registers at this shape
                        print(f"  skip {c}: {type(exc).__name__}")
                best_us, best = min(timed, key=lambda t: t[0])
                line += f"; best {best_us:.1f} us ({best})"
            print(line, flush=True)
        w = dense = None  # free before the next shape
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of configs per shape")
    parser.add_argument("--types", default="int4", help="comma-separated weight types to time")
    args = parser.parse_args()
    for weight_type in args.types.split(","):
        bench(args.sweep, weight_type)


if __name__ == "__main__":
    main()


# The prescaled tiles (`wna16_tc`) in each operand order and step form, at a decode batch, a small prompt and a
# prompt chunk's rows.
PRESCALED = {
    "ps1": WNA16Config(16, 128, 128, 0, 1, 4, 4, swap_ab=True, prescale=True),
    "ps8": WNA16Config(16, 128, 128, 0, 1, 4, 4, swap_ab=True, nibble_dots=True, prescale=True),
    "ps1n-128": WNA16Config(128, 128, 128, 1, 8, 8, 3, prescale=True),
    "ps8n-128": WNA16Config(128, 128, 128, 1, 8, 8, 3, nibble_dots=True, prescale=True),
    "ps1-128": WNA16Config(128, 128, 128, 1, 8, 8, 3, swap_ab=True, prescale=True),
}


@pytest.mark.parametrize("name", list(PRESCALED))
@pytest.mark.parametrize("M", [16, 64, 300])
def test_prescaled_tiles_match_float64_8b_shapes(shape_weight, name, M):
    N, K, w = shape_weight
    x = make_x(M, K, seed=200 + M)
    assert_weight_rounded(wq.wna16_gemm(x, *w, torch.bfloat16, config=PRESCALED[name]), x, w)


def test_prescaled_tiles_with_zeros_act_order_and_bias():
    N, K = 4096, 4096
    w = make_weight(N, K, "uint4", act_order=True, seed=13)
    for M, cfg in ((16, PRESCALED["ps1"]), (200, PRESCALED["ps8n-128"])):
        x = make_x(M, K, seed=14 + M)
        bias = torch.randn(N, device="cuda").to(torch.bfloat16)
        out = wq.wna16_gemm(x, *w, torch.bfloat16, bias, config=cfg)
        assert_weight_rounded(out, x, w, bias, slack=bias.double().abs())


@pytest.mark.parametrize("name", ["ps1", "ps8"])
def test_prescaled_tiles_capture_in_a_cuda_graph(name):
    """The x column gather of the nibble dots and the split-K tail inside a captured graph: replays equal eager."""
    w = make_weight(4096, 4096, "int4", act_order=True, seed=15)
    cfg = PRESCALED[name]
    x = make_x(16, 4096, seed=16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        wq.wna16_gemm(x, *w, torch.bfloat16, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = wq.wna16_gemm(x, *w, torch.bfloat16, config=cfg)
    for seed in (17, 18):
        x.copy_(make_x(16, 4096, seed=seed))
        graph.replay()
        assert torch.equal(static_out, wq.wna16_gemm(x, *w, torch.bfloat16, config=cfg))
