"""The CPU fast path of paged attention (kernels/cpu/attention.py) against `paged_attention_ref` in float64."""

from __future__ import annotations

import pytest
import torch

from kestrel import ops
from kestrel.kernels.attention import paged_attention_ref
from kestrel.kernels.cpu.attention import paged_attention_cpu

BLOCK = 16


def _case(query_lens: list[int], context_lens: list[int], num_heads: int, num_kv_heads: int, head_size: int,
          cache_dtype: torch.dtype = torch.float32, q_dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // BLOCK) for c in context_lens) + 4
    width = max(-(-c // BLOCK) for c in context_lens) + 2
    k_cache = torch.randn(num_blocks, BLOCK, num_kv_heads, head_size, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, BLOCK, num_kv_heads, head_size, generator=gen).to(cache_dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(context_lens), width), -1, dtype=torch.int32)  # padding past a sequence's blocks
    for s, ctx in enumerate(context_lens):
        n = -(-ctx // BLOCK)
        tables[s, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(query_lens), num_heads, head_size, generator=gen).to(q_dtype)
    return q, k_cache, v_cache, qsl, torch.tensor(context_lens, dtype=torch.int32), tables


def _oracle(q, k_cache, v_cache, qsl, seq_lens, tables, scale, **kw) -> torch.Tensor:
    if k_cache.dtype == torch.float8_e4m3fn:
        k_cache, v_cache = k_cache.to(torch.float64), v_cache.to(torch.float64)
    return paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), qsl, seq_lens, tables, scale, **kw)


MIXED = ([1, 7, 0, 1, 33, 1, 2], [9, 40, 5, 100, 33, 17, 64])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("soft_cap", [None, 4.0])
def test_matches_reference_float32(num_heads: int, num_kv_heads: int, window: int | None,
                                   soft_cap: float | None) -> None:
    q, kc, vc, qsl, lens, tables = _case(*MIXED, num_heads, num_kv_heads, 32)
    got = paged_attention_cpu(q, kc, vc, qsl, lens, tables, 0.2, window, logit_soft_cap=soft_cap)
    want = _oracle(q, kc, vc, qsl, lens, tables, 0.2, sliding_window=window, logit_soft_cap=soft_cap)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("query_lens,context_lens", [([1] * 5, [1, 16, 17, 50, 3]), ([20, 20], [20, 45])])
def test_decode_only_and_prefill_only(query_lens: list[int], context_lens: list[int]) -> None:
    q, kc, vc, qsl, lens, tables = _case(query_lens, context_lens, 8, 2, 64, seed=1)
    got = paged_attention_cpu(q, kc, vc, qsl, lens, tables, 0.125)
    torch.testing.assert_close(got.double(), _oracle(q, kc, vc, qsl, lens, tables, 0.125), atol=2e-6, rtol=2e-6)


def test_bf16_rounds_like_the_reference() -> None:
    """bf16 queries and cache: both compute in float32 and round once; they differ by at most one bf16 step."""
    q, kc, vc, qsl, lens, tables = _case(*MIXED, 8, 2, 32, cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16)
    got = paged_attention_cpu(q, kc, vc, qsl, lens, tables, 0.2, 7, logit_soft_cap=3.0)
    want = paged_attention_ref(q, kc, vc, qsl, lens, tables, 0.2, 7, logit_soft_cap=3.0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=8e-3)


def test_fp8_cache_with_scales() -> None:
    q, kc, vc, qsl, lens, tables = _case(*MIXED, 4, 2, 32, cache_dtype=torch.float8_e4m3fn)
    got = paged_attention_cpu(q, kc, vc, qsl, lens, tables, 0.2, k_scale=0.5, v_scale=2.0)
    want = _oracle(q, kc, vc, qsl, lens, tables, 0.2, k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("query_lens", [[1, 3], [1, 1], [3, 3]])
def test_writes_only_the_query_rows_of_out(query_lens: list[int]) -> None:
    """`out` longer than the batch's tokens: rows past them keep their values, as with the reference (mixed
    query lengths scatter their rows; one length for every sequence copies them)."""
    q, kc, vc, qsl, lens, tables = _case(query_lens, [10, 3], 4, 2, 16)
    out = torch.full((q.shape[0] + 2, 4, 16), 7.0)
    result = paged_attention_cpu(q, kc, vc, qsl, lens, tables, 0.25, out=out[: q.shape[0]])
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out[q.shape[0]:], torch.full((2, 4, 16), 7.0))
    torch.testing.assert_close(out[: q.shape[0]].double(), _oracle(q, kc, vc, qsl, lens, tables, 0.25),
                               atol=2e-6, rtol=2e-6)


def test_float64_is_the_reference() -> None:
    q, kc, vc, qsl, lens, tables = _case(*MIXED, 4, 2, 16)
    q, kc, vc = q.double(), kc.double(), vc.double()
    assert torch.equal(paged_attention_cpu(q, kc, vc, qsl, lens, tables, 0.3),
                       paged_attention_ref(q, kc, vc, qsl, lens, tables, 0.3))


def test_soft_cap_must_be_positive() -> None:
    q, kc, vc, qsl, lens, tables = _case([1], [4], 4, 2, 16)
    with pytest.raises(ValueError, match="logit_soft_cap"):
        paged_attention_cpu(q, kc, vc, qsl, lens, tables, 0.3, logit_soft_cap=0.0)


def test_ops_dispatches_the_fast_path_unless_references_are_asked_for(monkeypatch) -> None:
    calls: list[str] = []
    from kestrel.kernels import attention as reference_module
    from kestrel.kernels.cpu import attention as fast_module

    monkeypatch.setattr(fast_module, "paged_attention_cpu", lambda *a, **k: calls.append("fast"))
    monkeypatch.setattr(reference_module, "paged_attention_ref", lambda *a, **k: calls.append("ref"))
    q, kc, vc, qsl, lens, tables = _case([1], [4], 4, 2, 16)
    ops.paged_attention(q, kc, vc, qsl, lens, tables, 0.3)
    with ops.cpu_references():
        ops.paged_attention(q, kc, vc, qsl, lens, tables, 0.3)
    ops.paged_attention(q, kc, vc, qsl, lens, tables, 0.3)
    assert calls == ["fast", "ref", "fast"]
