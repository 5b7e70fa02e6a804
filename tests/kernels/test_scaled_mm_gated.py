"""scaled_mm_gated: the FP8 gate/up GEMM whose epilogue writes act(gate) * up (interpreted on CPU), against the two
launches it replaces (bit for bit), a float64 oracle, and its PyTorch reference.

Shapes are small and odd (M, N, K not multiples of any tile) and the configs small, so the interpreter is quick and
both the TMA and the pointer paths, persistent grids and several output tiles per program run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kestrel.kernels import activation as act_kernels
from kestrel.kernels import scaled_mm as smm
from kestrel.kernels.scaled_mm import MMConfig

# (config, M, N outputs, K); K % 16 == 0 where the config asks for TMA descriptors. A config is the [2N, K] GEMM's:
# the gated launch halves its longer side (two accumulators).
PATHS = [
    (MMConfig(swap=False, block_r=16, block_c=64, block_k=32, persistent=True, tma=True), 37, 45, 112),
    (MMConfig(swap=False, block_r=32, block_c=32, block_k=32, group=2, tma=False), 70, 29, 200),
    (MMConfig(swap=False, block_r=16, block_c=32, block_k=64, persistent=True, tma=False), 19, 50, 96),
    (MMConfig(swap=False, block_r=64, block_c=32, block_k=32, persistent=True, tma=True), 90, 40, 64),  # rows halved
]
ACTIVATIONS = ["silu", "gelu", "gelu_tanh"]


def make_inputs(M, N, K, sb_per_channel, bias, seed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, K, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    b = (torch.randn(2 * N, K, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    sa = (torch.rand(M, 1, generator=g) + 0.05) * 1e-3
    sb = (torch.rand(2 * N, 1, generator=g) + 0.05) * 1e-3 if sb_per_channel else torch.tensor(6e-4)
    bias_t = (torch.randn(2 * N, generator=g) * 2).to(torch.bfloat16) if bias else None
    return a, b, sa, sb, bias_t


def oracle(a, b, sa, sb, bias, activation) -> np.ndarray:
    """float64 act(gate) * up with no rounding anywhere."""
    acc = a.float().double().numpy() @ b.float().double().numpy().T
    out = sa.double().numpy().reshape(-1, 1) * sb.double().numpy().reshape(1, -1) * acc
    if bias is not None:
        out = out + bias.double().numpy().reshape(1, -1)
    gate, up = np.split(out, 2, axis=1)
    return act_kernels.activate_ref(torch.from_numpy(gate), activation).numpy() * up


def assert_near_oracle(out: torch.Tensor, expected: np.ndarray) -> None:
    """Norm-wise: gate and up rounded to bf16 before the product, the product rounded once (a few bf16 ulps)."""
    got = out.double().numpy()
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - expected) <= 2.0**-7 * np.linalg.norm(expected)


def assert_same_as_two_launches(out: torch.Tensor, two_launches: torch.Tensor, device) -> None:
    """Bit for bit in the interpreter. On a GPU the gated launch's tile has half the rows or columns of the plain
    one's, so its dots may compile to another MMA shape whose fp32 sums round differently (seen on an H100 for a
    few elements of a 32-row tile against a 64-row one): there each value may sit a bf16 rounding step away."""
    if torch.device(device).type != "cuda":
        assert torch.equal(out, two_launches)
        return
    scale = two_launches.float().abs().amax().item()
    torch.testing.assert_close(out.float(), two_launches.float(), rtol=2.0**-6, atol=2.0**-7 * scale)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("path", range(len(PATHS)))
@pytest.mark.parametrize("sb_per_channel,bias", [(True, False), (False, True), (True, True)],
                         ids=["channel", "tensor-bias", "channel-bias"])
def test_gated_equals_the_gemm_then_the_activation(path, activation, sb_per_channel, bias, device):
    cfg, M, N, K = PATHS[path]
    a, b, sa, sb, bias_t = make_inputs(M, N, K, sb_per_channel, bias, seed=path + 7 * M)
    on = [t.to(device) if t is not None else None for t in (a, b, sa, sb, bias_t)]
    out = smm.scaled_mm_gated(*on[:4], torch.bfloat16, activation, on[4], config=cfg)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    two_launches = act_kernels.act_mul(smm.scaled_mm(*on[:4], torch.bfloat16, on[4], config=cfg), activation)
    assert_same_as_two_launches(out.cpu(), two_launches.cpu(), device)
    assert_near_oracle(out.cpu(), oracle(a, b, sa, sb, bias_t, activation))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_matches_the_oracle_and_the_kernel(activation, device):
    cfg, M, N, K = PATHS[0]
    a, b, sa, sb, bias_t = make_inputs(M, N, K, True, True, seed=3)
    ref = smm.scaled_mm_gated_ref(a, b, sa, sb, torch.bfloat16, activation, bias_t)
    assert ref.shape == (M, N) and ref.dtype == torch.bfloat16
    assert_near_oracle(ref, oracle(a, b, sa, sb, bias_t, activation))
    on = [t.to(device) for t in (a, b, sa, sb, bias_t)]
    kernel = smm.scaled_mm_gated(*on[:4], torch.bfloat16, activation, on[4], config=cfg).cpu()
    # The reference's exp / erf are torch's, the kernel's Triton's: equal up to their last bits.
    assert (kernel.float() - ref.float()).abs().max() <= 2.0**-7 * ref.float().abs().max()


def test_fp16_output_and_a_default_config(device):
    M, N, K = 70, 40, 64  # M over SMALL_M: the table's (or default) large-M tile, halved
    a, b, sa, sb, _ = make_inputs(M, N, K, True, False, seed=11)
    on = [t.to(device) for t in (a, b, sa, sb)]
    out = smm.scaled_mm_gated(*on, torch.float16, "silu")
    assert out.dtype == torch.float16
    assert torch.equal(out.cpu(), act_kernels.act_mul(smm.scaled_mm(*on, torch.float16), "silu").cpu())


def test_decode_sized_rows_take_a_large_m_tile(device):
    """A swapped (decode) config has no gated form: the launcher takes the default large-M tile instead."""
    M, N, K = 5, 24, 64
    a, b, sa, sb, _ = make_inputs(M, N, K, True, False, seed=5)
    on = [t.to(device) for t in (a, b, sa, sb)]
    swapped = MMConfig(swap=True, block_r=16, block_c=16, block_k=32, split_k=2, tma=False)
    out = smm.scaled_mm_gated(*on, torch.bfloat16, "silu", config=swapped)
    assert torch.equal(out.cpu(), act_kernels.act_mul(smm.scaled_mm(*on, torch.bfloat16), "silu").cpu())


def test_invalid_arguments_raise(device):
    a, b, sa, sb, _ = make_inputs(4, 8, 32, True, False, seed=1)
    with pytest.raises(ValueError, match="FP8 activations and weights only"):
        smm.scaled_mm_gated(a.float().to(torch.int8), b.float().to(torch.int8), sa, sb, torch.bfloat16)
    with pytest.raises(ValueError, match="gate rows then up rows"):
        smm.scaled_mm_gated(a, b[:15], sa, sb[:15], torch.bfloat16)
    with pytest.raises(ValueError, match="unknown activation"):
        smm.scaled_mm_gated(a.to(device), b.to(device), sa.to(device), sb.to(device), torch.bfloat16, "relu")
    empty = smm.scaled_mm_gated(a[:0], b, sa[:0], sb, torch.bfloat16)
    assert empty.shape == (0, 8)
