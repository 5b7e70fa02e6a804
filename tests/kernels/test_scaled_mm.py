"""W8A8 scaled_mm: the Triton kernel (interpreted on CPU) and its reference against a float64 oracle.

The oracle is computed here with numpy (int64 for int8, float64 for fp8), independently of the module.
Shapes are small and odd (M, N, K not multiples of any tile); configs are small so the interpreter is quick
and every path runs: swapped (small M) with and without split-K, persistent large-M with and without TMA
descriptors, and the tuned/default selection.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from kestrel.kernels import common
from kestrel.kernels import scaled_mm as smm
from kestrel.kernels.scaled_mm import MMConfig

BF16_RTOL = 2.0**-8 + 1e-5  # half an ulp of bf16 (8 significant bits) plus fp32 epilogue slack
FP16_RTOL = 2.0**-11 + 1e-5

# (config, M, N, K): one per path; K % 16 == 0 where the config asks for TMA descriptors.
PATHS = [
    (MMConfig(swap=True, block_r=16, block_c=16, block_k=32, split_k=3, tma=False), 5, 75, 200),
    (MMConfig(swap=True, block_r=32, block_c=16, block_k=64, split_k=1, tma=True), 13, 75, 208),
    (MMConfig(swap=False, block_r=16, block_c=32, block_k=32, persistent=True, tma=True), 37, 75, 112),
    (MMConfig(swap=False, block_r=32, block_c=16, block_k=32, group=2, tma=False), 45, 61, 200),
    # k_tiles = 3 over 4 splits leaves one split empty; persistent with 4 programs walks many tiles.
    (MMConfig(swap=True, block_r=16, block_c=16, block_k=32, split_k=4, tma=True, persistent=True), 3, 90, 96),
    (None, 20, 40, 72),  # default config for a small M
]
DTYPES = [torch.int8, torch.float8_e4m3fn]
CASES = [
    (dt, sa, sb, bias, azp)
    for dt in DTYPES
    for sa, sb, bias in itertools.product(("tensor", "token"), ("tensor", "channel"), (False, True))
    for azp in ((None, "tensor", "token") if dt == torch.int8 else (None,))
]


def make_inputs(dtype, M, N, K, sa_mode, sb_mode, bias, azp_mode, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        a = torch.randint(-128, 128, (M, K), generator=g, dtype=torch.int8)
        b = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    else:
        a = (torch.randn(M, K, generator=g) * 60).clamp(-448, 448).to(dtype)
        b = (torch.randn(N, K, generator=g) * 60).clamp(-448, 448).to(dtype)
    sa = (torch.rand(M, 1, generator=g) + 0.05) * 1e-2 if sa_mode == "token" else torch.tensor(3e-3)
    sb = (torch.rand(N, 1, generator=g) + 0.05) * 1e-2 if sb_mode == "channel" else torch.tensor(7e-3)
    bias_t = (torch.randn(N, generator=g) * 5).to(torch.bfloat16) if bias else None
    adj = zp = None
    if azp_mode is not None:
        adj = b.to(torch.int32).sum(dim=1, dtype=torch.int32)
        zp = (torch.randint(-128, 128, (M,), generator=g, dtype=torch.int32) if azp_mode == "token"
              else torch.tensor(-17, dtype=torch.int32))
    args = [a, b, sa, sb, bias_t, adj, zp]
    return [t.to(device) if t is not None else None for t in args]


def oracle(a, b, sa, sb, bias, adj, azp) -> np.ndarray:
    """float64 (int64 for the int8 accumulation) expectation of the epilogue formula."""
    if a.dtype == torch.int8:
        acc = a.cpu().numpy().astype(np.int64) @ b.cpu().numpy().astype(np.int64).T
        if azp is not None:
            z = azp.cpu().numpy().astype(np.int64).reshape(-1, 1)
            acc = acc - z * adj.cpu().numpy().astype(np.int64).reshape(1, -1)
        acc = acc.astype(np.float64)
    else:
        acc = a.cpu().float().numpy().astype(np.float64) @ b.cpu().float().numpy().astype(np.float64).T
    out = sa.cpu().double().numpy().reshape(-1, 1) * sb.cpu().double().numpy().reshape(1, -1) * acc
    if bias is not None:
        out = out + bias.cpu().double().numpy().reshape(1, -1)
    return out


def assert_close(out: torch.Tensor, expected: np.ndarray, rtol: float, atol_frac: float = 1e-5) -> None:
    got = out.cpu().double().numpy()
    assert np.isfinite(got).all()
    scale = np.abs(expected).max()
    bad = np.abs(got - expected) > rtol * np.abs(expected) + atol_frac * scale
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements off, first at {np.argwhere(bad)[0]}"
    rel = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert rel < 1e-2


@pytest.mark.parametrize("case_index", range(len(CASES)))
def test_triton_matches_float64_oracle(case_index, device):
    dtype, sa_mode, sb_mode, bias, azp_mode = CASES[case_index]
    cfg, M, N, K = PATHS[case_index % len(PATHS)]
    args = make_inputs(dtype, M, N, K, sa_mode, sb_mode, bias, azp_mode, device, seed=case_index)
    out = smm.scaled_mm(*args[:4], torch.bfloat16, *args[4:], config=cfg)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    assert_close(out, oracle(*args), BF16_RTOL)


@pytest.mark.parametrize("case_index", range(len(CASES)))
def test_reference_matches_float64_oracle(case_index):
    dtype, sa_mode, sb_mode, bias, azp_mode = CASES[case_index]
    args = make_inputs(dtype, 7, 33, 130, sa_mode, sb_mode, bias, azp_mode, "cpu", seed=case_index)
    out = smm.scaled_mm_ref(*args[:4], torch.bfloat16, *args[4:])
    assert_close(out, oracle(*args), BF16_RTOL)


@pytest.mark.parametrize("path", [0, 2])
def test_int8_accumulation_is_exact(path, device):
    """Unit scales and |acc| < 2048: fp16 holds every accumulator exactly, so out must equal it."""
    cfg, M, N, K = PATHS[path]
    g = torch.Generator().manual_seed(5)
    a = torch.randint(-3, 4, (M, K), generator=g, dtype=torch.int8)
    b = torch.randint(-2, 3, (N, K), generator=g, dtype=torch.int8)
    one = torch.tensor(1.0)
    out = smm.scaled_mm(a.to(device), b.to(device), one.to(device), one.to(device), torch.float16, config=cfg)
    exact = a.numpy().astype(np.int64) @ b.numpy().astype(np.int64).T
    assert np.abs(exact).max() < 2048
    np.testing.assert_array_equal(out.cpu().double().numpy(), exact.astype(np.float64))


def test_int8_large_accumulation_exact_with_zero_point(device):
    """Full-range int8 with K=512: |acc| up to 2^23, still exact through int32 and the fp32 conversion."""
    cfg, M, N, _ = PATHS[2]
    args = make_inputs(torch.int8, M, N, 512, "token", "channel", True, "token", device, seed=11)
    out = smm.scaled_mm(*args[:4], torch.bfloat16, *args[4:], config=cfg)
    assert_close(out, oracle(*args), BF16_RTOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp16_output(dtype, device):
    cfg, M, N, K = PATHS[0]
    args = make_inputs(dtype, M, N, K, "token", "channel", True, None, device, seed=3)
    out = smm.scaled_mm(*args[:4], torch.float16, *args[4:], config=cfg)
    assert out.dtype == torch.float16
    assert_close(out, oracle(*args), FP16_RTOL)


def test_strided_activation_rows(device):
    """A view with a row stride larger than K (e.g. a slice of a fused projection output)."""
    cfg, M, N, K = PATHS[3]
    args = make_inputs(torch.int8, M, N, K, "token", "channel", False, None, device, seed=4)
    wide = torch.zeros(M, K + 24, dtype=torch.int8, device=device)
    wide[:, 8 : 8 + K] = args[0]
    args[0] = wide[:, 8 : 8 + K]
    out = smm.scaled_mm(*args[:4], torch.bfloat16, config=cfg)
    assert_close(out, oracle(*args[:4], None, None, None), BF16_RTOL)


def test_single_row_and_empty(device):
    cfg, _, N, K = PATHS[0]
    args = make_inputs(torch.float8_e4m3fn, 1, N, K, "token", "channel", False, None, device)
    assert_close(smm.scaled_mm(*args[:4], torch.bfloat16, config=cfg), oracle(*args), BF16_RTOL)
    empty = smm.scaled_mm(args[0][:0], args[1], args[2][:0], args[3], torch.bfloat16)
    assert empty.shape == (0, N)


def test_split_k_counters_are_left_zeroed(device):
    cfg, M, N, K = PATHS[0]
    args = make_inputs(torch.int8, M, N, K, "token", "channel", False, None, device)
    first = smm.scaled_mm(*args[:4], torch.bfloat16, config=cfg)
    assert int(common.arrival_counters(torch.device(device)).abs().sum()) == 0
    second = smm.scaled_mm(*args[:4], torch.bfloat16, config=cfg)
    assert torch.equal(first, second)


@pytest.mark.parametrize(
    "bad",
    [
        dict(b_dtype=torch.float8_e4m3fn),  # mixed dtypes
        dict(scale_a_shape=(3, 1)),  # neither scalar nor [M, 1]
        dict(azp_only=True),  # azp without azp_adj
        dict(out_dtype=torch.float32, kernel_only=True),
        dict(out_dtype=torch.int32),
    ],
)
def test_invalid_arguments_raise(bad):
    a = torch.zeros(4, 32, dtype=torch.int8)
    b = torch.zeros(8, 32, dtype=bad.get("b_dtype", torch.int8))
    sa = torch.ones(*bad.get("scale_a_shape", (4, 1)))
    azp = torch.zeros(4, dtype=torch.int32) if bad.get("azp_only") else None
    for fn in (smm.scaled_mm,) if bad.get("kernel_only") else (smm.scaled_mm, smm.scaled_mm_ref):
        with pytest.raises(ValueError):
            fn(a, b, sa, torch.ones(8, 1), bad.get("out_dtype", torch.bfloat16), None, None, azp)


def test_reference_writes_float32_without_rounding():
    """The float32 output (tensor-parallel partial sums of float32 models) is the epilogue before any rounding."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (4, 32), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (8, 32), generator=g, dtype=torch.int8)
    sa, sb = torch.rand(4, 1, generator=g) + 0.5, torch.rand(8, 1, generator=g) + 0.5
    out = smm.scaled_mm_ref(a, b, sa, sb, torch.float32)
    expected = (sa * sb.T) * (a.double() @ b.double().T).float()
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    assert not torch.equal(out, out.to(torch.bfloat16).float())


def test_m_buckets():
    assert [smm.m_bucket(m) for m in (1, 16, 17, 64, 65, 1000, 4096, 4097, 100000)] == [
        16, 16, 32, 64, 128, 1024, 4096, 8192, 8192]


def test_lookup_uses_nearest_bucket_on_the_same_side():
    small = MMConfig(swap=True, block_r=64, block_c=64, block_k=256, split_k=4).to_json()
    large = MMConfig(swap=False, block_r=128, block_c=256, block_k=128, persistent=True).to_json()
    entries = {"64": small, "1024": large}
    assert smm.lookup(entries, 3) == MMConfig.from_json(small).__class__(**{**small, "block_c": 16})
    assert smm.lookup(entries, 300) == MMConfig.from_json(large)
    assert smm.lookup({}, 5) is None


def test_default_configs_cover_both_regimes():
    small = smm.default_config(4096, 4096, 8, 132)
    assert small.swap and small.block_c == 16 and small.split_k >= 1
    assert not smm.default_config(4096, 4096, 2048, 132).swap


def test_shipped_tuning_tables_parse():
    for path in smm.TUNING_DIR.glob("scaled_mm_*.json"):
        table = json.loads(path.read_text())
        for per_shape in table["configs"].values():
            for entries in per_shape.values():
                for bucket, cfg in entries.items():
                    parsed = MMConfig.from_json(cfg)
                    assert int(bucket) == smm.m_bucket(int(bucket))
                    assert parsed.swap == (int(bucket) <= smm.SMALL_M) or not parsed.swap


@pytest.mark.parametrize("dtype", DTYPES)
def test_hopper_pdl_and_prefetch(dtype, device):
    """Programmatic dependent launch + L2 weight prefetch: compiled-GPU only (inline PTX)."""
    if device.type != "cuda":
        pytest.skip("PDL and the bulk prefetch are GPU-only")
    cfg = MMConfig(swap=True, block_r=64, block_c=16, block_k=128, split_k=3, tma=True, pdl=True, prefetch=True,
                   precise_acc=True)
    args = make_inputs(dtype, 9, 200, 1024, "token", "channel", True, None, device, seed=12)
    for _ in range(3):  # back to back, so each launch overlaps the previous one's tail
        out = smm.scaled_mm(*args[:4], torch.bfloat16, *args[4:], config=cfg)
    # int8 is exact, so it pins down any ordering bug. Hopper's FP8 MMA keeps only ~14 bits of each
    # in-flight partial sum even with promotion every BLOCK_K, so outputs near a cancellation carry an
    # absolute error of about 2^-13 of the partial-sum magnitude: hence the wider absolute floor for fp8.
    assert_close(out, oracle(*args), BF16_RTOL, 1e-5 if dtype == torch.int8 else 2e-3)


def test_fp8_fast_accumulation_stays_within_the_issue_bound(device):
    """sm_90 FP8 tensor cores accumulate with reduced precision unless promoted (precise_acc); the fast
    default must still meet the 1e-2 relative bound at a long K."""
    if device.type != "cuda":
        pytest.skip("the interpreter accumulates exactly in fp32")
    args = make_inputs(torch.float8_e4m3fn, 32, 256, 4096, "token", "channel", False, None, device, seed=13)
    expected = oracle(*args)
    for precise in (False, True):
        cfg = replace(smm.default_config(256, 4096, 32, 132), precise_acc=precise)
        out = smm.scaled_mm(*args[:4], torch.bfloat16, config=cfg).cpu().double().numpy()
        rel = np.linalg.norm(out - expected) / np.linalg.norm(expected)
        assert rel < (4e-3 if precise else 1e-2)


def test_kernels_really_run_in_the_interpreter():
    if torch.cuda.is_available():
        pytest.skip("compiled kernels on a GPU machine")
    assert type(smm._scaled_mm_kernel).__name__ == "InterpretedFunction"
