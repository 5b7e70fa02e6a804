"""The CPU RoPE + KV write and KV write fast paths (kernels/cpu/rope_kv.py): bit-identical to the references."""

from __future__ import annotations

import pytest
import torch

from kestrel import ops
from kestrel.kernels.cpu import native
from kestrel.kernels.cpu import rope_kv as fast
from kestrel.kernels.cpu.rope_kv import rope_store_kv_cpu, store_kv_cpu
from kestrel.kernels.rope_kv import rope_store_kv_ref
from kestrel.kernels.store_kv import store_kv_ref

HEADS, KV_HEADS, HEAD, BLOCKS, BLOCK = 4, 2, 32, 6, 8


def _inputs(dtype: torch.dtype, tokens: int, with_skips: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, HEADS * HEAD, generator=gen).to(dtype)
    k = torch.randn(tokens, KV_HEADS * HEAD, generator=gen).to(dtype)
    v = torch.randn(tokens, KV_HEADS * HEAD, generator=gen).to(dtype)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    slots = torch.randperm(BLOCKS * BLOCK, generator=gen)[:tokens]
    if with_skips:
        slots[::3] = -1
    angles = torch.rand(64, HEAD // 2, generator=gen) * 6.0
    return q, k, v, positions, slots, angles.cos(), angles.sin()


def _caches(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(BLOCKS, BLOCK, KV_HEADS, HEAD).to(dtype), torch.zeros(BLOCKS, BLOCK, KV_HEADS, HEAD).to(dtype))


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("rotary_dim", [HEAD, HEAD // 2])
@pytest.mark.parametrize("with_skips", [False, True])
def test_rope_store_kv_bit_identical(dtype, cache_dtype, rotary_dim: int, with_skips: bool) -> None:
    q, k, v, positions, slots, cos, sin = _inputs(dtype, 11, with_skips)
    cos, sin = cos[:, : rotary_dim // 2], sin[:, : rotary_dim // 2]
    scales = (0.5, 2.0) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    kc_ref, vc_ref = _caches(cache_dtype)
    kc, vc = _caches(cache_dtype)
    want = rope_store_kv_ref(positions, q, k, v, cos, sin, rotary_dim, kc_ref, vc_ref, slots, *scales)
    got = rope_store_kv_cpu(positions, q, k, v, cos, sin, rotary_dim, kc, vc, slots, *scales)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8))


@pytest.mark.skipif(native.find_compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [HEAD, HEAD // 2])
def test_c_kernel_on_a_qkv_split_is_bit_identical(cache_dtype, rotary_dim: int) -> None:
    """q, k and v as the attention layer hands them over (views of one qkv row), enough tokens to go parallel."""
    tokens, blocks = 600, 80
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD, generator=gen) * 3
    q, k, v = qkv.split([HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
    positions = torch.randint(0, 700, (tokens,), generator=gen)
    slots = torch.randperm(blocks * BLOCK, generator=gen)[:tokens]
    slots[::7] = -1
    angles = torch.rand(700, rotary_dim // 2, generator=gen) * 6.0
    cos, sin = angles.cos(), angles.sin()
    caches = [torch.zeros(blocks, BLOCK, KV_HEADS, HEAD, dtype=cache_dtype) for _ in range(4)]
    want = rope_store_kv_ref(positions, q, k, v, cos, sin, rotary_dim, caches[0], caches[1], slots)
    got = fast._rope_store_kv_c(positions, q, k, v, cos, sin, rotary_dim, caches[2], caches[3], slots)
    assert got is not None and torch.equal(got, want)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    # a position past the tables or a slot past the cache: the kernel declines, the PyTorch path then raises
    bad = positions.clone()
    bad[5] = 700
    assert fast._rope_store_kv_c(bad, q, k, v, cos, sin, rotary_dim, caches[2], caches[3], slots) is None


@pytest.mark.parametrize("with_skips", [False, True])
def test_store_kv_bit_identical(with_skips: bool) -> None:
    _, k, v, _, slots, _, _ = _inputs(torch.float32, 9, with_skips, seed=1)
    k, v = k.view(9, KV_HEADS, HEAD), v.view(9, KV_HEADS, HEAD)
    kc_ref, vc_ref = _caches(torch.float32)
    kc, vc = _caches(torch.float32)
    store_kv_ref(k, v, kc_ref, vc_ref, slots)
    store_kv_cpu(k, v, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_ops_dispatch(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(fast, "store_kv_cpu", lambda *a: calls.append("fast"))
    _, k, v, _, slots, _, _ = _inputs(torch.float32, 4, False)
    kc, vc = _caches(torch.float32)
    k, v = k.view(4, KV_HEADS, HEAD), v.view(4, KV_HEADS, HEAD)
    ops.store_kv(k, v, kc, vc, slots)
    with ops.cpu_references():
        ops.store_kv(k, v, kc, vc, slots)
    assert calls == ["fast"] and kc.abs().sum() > 0
