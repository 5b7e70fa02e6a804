"""The CPU's one-pass RMSNorm and SiLU-and-multiply (kernels/cpu/elementwise.c) against float64 references, and the
PyTorch fallbacks for what they do not take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel import ops
from kestrel.kernels.activation import act_mul_ref
from kestrel.kernels.cpu import native
from kestrel.kernels.cpu.elementwise import act_mul_cpu, rms_norm_cpu
from kestrel.kernels.norm import rms_norm_ref

pytestmark = pytest.mark.skipif(native.find_compiler() is None, reason="no C compiler")


def rms_norm64(x, weight, eps, unit_offset=False):
    x = x.double()
    normed = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed * ((1.0 + weight.double()) if unit_offset else weight.double())


@pytest.mark.parametrize("shape", [(1, 256), (64, 896), (3, 5, 100), (700, 96), (0, 64), (2, 17)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_matches_float64(shape, with_residual, unit_offset):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * 3
    residual = torch.randn(shape, generator=gen) if with_residual else None
    weight = torch.randn(shape[-1], generator=gen)
    got = rms_norm_cpu(x, weight, 1e-6, residual, unit_offset)
    summed = x if residual is None else (x.double() + residual.double())
    want = rms_norm64(summed, weight, 1e-6, unit_offset)
    out = got[0] if with_residual else got
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    if with_residual:
        assert torch.equal(got[1], x + residual)  # one float32 add, as the reference's


@pytest.mark.parametrize("shape", [(1, 2 * 640), (64, 2 * 4864), (3, 4, 2 * 33), (0, 64)])
def test_silu_mul_matches_float64(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * 4
    gate, up = x.double().chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = act_mul_cpu(x, "silu")
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)


def test_what_the_kernels_do_not_take_goes_to_the_references():
    x = torch.randn(8, 64)
    weight = torch.randn(64)
    for odd in (x.bfloat16(), x[:, ::2], x.double()):
        w = weight[: odd.shape[-1]].to(odd.dtype) if odd.dtype != torch.float32 else weight[: odd.shape[-1]]
        assert torch.equal(rms_norm_cpu(odd, w, 1e-5), rms_norm_ref(odd, w, 1e-5))
    assert torch.equal(act_mul_cpu(x, "gelu"), act_mul_ref(x, "gelu"))
    assert torch.equal(act_mul_cpu(x.bfloat16(), "silu"), act_mul_ref(x.bfloat16(), "silu"))
    with ops.cpu_references():
        assert torch.equal(ops.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
        assert torch.equal(ops.act_mul(x, "silu"), act_mul_ref(x, "silu"))
