"""The W8A8 block GEMM (`kernels/block_fp8_mm.py`) and the per-group FP8 input quantizer against float64 oracles."""

from __future__ import annotations

import pytest
import sm90
import torch

from kestrel import ops
from kestrel.kernels import common
from kestrel.kernels.block_fp8_mm import DEFAULT_CONFIG, BlockMMConfig, block_fp8_mm, block_fp8_mm_ref, select_config

FP8 = torch.float8_e4m3fn
FP32 = 2.0**-23


def oracle(a, b, scale_a, scale_b, group, bias=None) -> torch.Tensor:
    """float64: every e4m3 value times its group's scale, then the product."""
    K = a.shape[1]
    sa = scale_a.double().repeat_interleave(group, 1)[:, :K]
    sb = scale_b.double().repeat_interleave(group, 1)[:, :K]
    out = (a.double() * sa) @ (b.double() * sb).T
    return out if bias is None else out + bias.double()


def operands(M: int, N: int, K: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = -(-K // group)
    a = (torch.randn(M, K, generator=g) * 100).clamp(-448, 448).to(FP8)
    b = (torch.randn(N, K, generator=g) * 100).clamp(-448, 448).to(FP8)
    scale_a = torch.rand(M, groups, generator=g) * 1e-2 + 1e-4
    scale_b = torch.rand(N, groups, generator=g) * 1e-2 + 1e-4
    return a, b, scale_a, scale_b


@pytest.mark.parametrize(("M", "N", "K", "group"), [
    (1, 64, 256, 128), (33, 160, 384, 128),  # whole groups; rows and columns past a tile
    (17, 96, 200, 64),  # a last group of 8 features
    (5, 48, 192, 96),  # groups of 96: K steps of 32
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_block_gemm_matches_float64(M, N, K, group, with_bias, device) -> None:
    a, b, scale_a, scale_b = operands(M, N, K, group, seed=M + N + K)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1)) if with_bias else None
    want = oracle(a, b, scale_a, scale_b, group, bias)
    for fn in (block_fp8_mm, block_fp8_mm_ref):
        dev = lambda t: None if t is None else t.to(device)  # noqa: E731
        got = fn(dev(a), dev(b), dev(scale_a), dev(scale_b), group, torch.float32, dev(bias)).cpu()
        # Each group's exact products summed in fp32, scaled: a few roundings of the largest partial sums. On a GPU
        # an e4m3 tensor-core dot accumulates its K step in fewer bits than fp32 (measured on an H100: about 2^-17
        # of the sum of the products' magnitudes), which is why the kernel adds each step's dot into fp32 apart.
        unit = 64 * FP32 if fn is block_fp8_mm_ref or device.type != "cuda" else 2.0**-13
        bound = unit * ((a.double().abs() * scale_a.double().repeat_interleave(group, 1)[:, :K])
                        @ (b.double().abs() * scale_b.double().repeat_interleave(group, 1)[:, :K]).T)
        assert ((got.double() - want).abs() <= bound + 1e-6).all(), fn.__name__


@pytest.mark.parametrize("config", [BlockMMConfig(16, 64, 4, 2, 1), BlockMMConfig(32, 256, 8, 4, 4)],
                         ids=["16x64", "32x256"])
def test_each_tile_of_a_tuning_table_matches_float64(config, device) -> None:
    """The tiles a tuned table may name: rows and columns past a tile, the grouped order over several row tiles."""
    M, N, K, group = 70, 320, 384, 128
    a, b, scale_a, scale_b = operands(M, N, K, group, seed=9)
    want = oracle(a, b, scale_a, scale_b, group)
    got = block_fp8_mm(a.to(device), b.to(device), scale_a.to(device), scale_b.to(device), group, torch.float32,
                       config=config).cpu()
    unit = 64 * FP32 if device.type != "cuda" else 2.0**-13
    bound = unit * ((a.double().abs() * scale_a.double().repeat_interleave(group, 1))
                    @ (b.double().abs() * scale_b.double().repeat_interleave(group, 1)).T)
    assert ((got.double() - want).abs() <= bound + 1e-6).all()


def test_the_table_entry_of_the_shape_and_m_bucket_is_taken(monkeypatch) -> None:
    small, large = BlockMMConfig(16, 64, 4, 4, 1), BlockMMConfig(128, 128, 8, 3, 8)
    table = {"6144,4096": {"16": small.to_json(), "1024": large.to_json()}}
    monkeypatch.setattr(common, "gpu_table", lambda kernel, device: table if kernel == "block_fp8_mm" else {})
    cuda = torch.device("cuda", 0)
    assert select_config(6144, 4096, 1, cuda) == small and select_config(6144, 4096, 16, cuda) == small
    assert select_config(6144, 4096, 17, cuda) == large and select_config(6144, 4096, 8192, cuda) == large
    assert select_config(4096, 4096, 16, cuda) == DEFAULT_CONFIG


def test_block_gemm_rounds_once_to_the_output_dtype(device) -> None:
    a, b, scale_a, scale_b = operands(9, 64, 128, 128, seed=4)
    full = block_fp8_mm(a.to(device), b.to(device), scale_a.to(device), scale_b.to(device), 128, torch.float32)
    half = block_fp8_mm(a.to(device), b.to(device), scale_a.to(device), scale_b.to(device), 128, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half.cpu(), full.cpu().to(torch.bfloat16))


def test_block_gemm_refuses_what_it_cannot_run() -> None:
    a, b, scale_a, scale_b = operands(2, 16, 64, 32, seed=0)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        block_fp8_mm(a.float(), b, scale_a, scale_b, 32, torch.float32)
    with pytest.raises(ValueError, match=r"scales \[M, 2\] and \[N, 2\]"):
        block_fp8_mm(a, b, scale_a[:, :1], scale_b, 32, torch.float32)
    with pytest.raises(ValueError, match="groups of 48 input features"):
        a48, b48, sa48, sb48 = operands(2, 16, 96, 48, seed=0)
        block_fp8_mm(a48, b48, sa48, sb48, 48, torch.float32)


@pytest.mark.parametrize(("K", "group"), [(256, 128), (200, 64)])
def test_per_group_quantizer_takes_each_groups_own_max(K, group) -> None:
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(K)) * torch.linspace(0.1, 30.0, K)
    q, scale = ops.quant_fp8_per_group(x, group)
    groups = -(-K // group)
    assert q.dtype == FP8 and q.shape == (7, K) and scale.shape == (7, groups)
    for g in range(groups):
        part = x[:, g * group:(g + 1) * group].double()
        torch.testing.assert_close(scale[:, g].double(), part.abs().amax(-1) / 448.0, rtol=FP32, atol=0.0)
        # each value within half an e4m3 step (3 mantissa bits) of its scaled self
        back = q[:, g * group:(g + 1) * group].double() * scale[:, g:g + 1].double()
        assert ((back - part).abs() <= part.abs() * 2.0**-4 + scale[:, g:g + 1].double() * 2.0**-9).all()


def _sm90_reports() -> list[tuple[str, str]]:
    """(PTX, ptxas report) of the block GEMM for the H200 with bf16 output, groups of 128 and of 96. Run in a process
    without TRITON_INTERPRET (see the test)."""
    from kestrel.kernels import block_fp8_mm as bm

    pointers = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
                "bias_ptr": "*fp32"}
    ints = ["M", "N", "K", "stride_am", "stride_bn", "stride_cm", "stride_sa", "stride_sb"]
    # What the launch finds at the model shapes (Triton specializes on multiples of 16): the weight and activation
    # rows 16-byte aligned, so their loads vectorize.
    aligned = frozenset({"a_ptr", "b_ptr", "c_ptr", "sa_ptr", "sb_ptr", "M", "N", "K", "stride_am", "stride_bn",
                         "stride_cm", "stride_sa", "stride_sb"})
    return [sm90.compile_sm90(bm._block_fp8_mm_kernel, pointers, ints,
                              dict(GROUP=group, HAS_BIAS=False, FAST=True, BLOCK_M=64, BLOCK_N=128,
                                   BLOCK_K=bm.k_step(group), GROUP_M=8), 4, aligned=aligned)
            for group in (128, 96)]


def test_block_gemm_compiles_for_sm90_on_tensor_cores_without_spills() -> None:
    for ptx, report in sm90.reports("test_block_fp8_mm", "_sm90_reports()"):
        assert " 0 bytes spill stores" in report, report
        assert "wgmma" in ptx or "mma.sync" in ptx  # the e4m3 dot on tensor cores
