"""The CPU fast path of paged attention (kernels/cpu/attention.py) against `paged_attention_ref` in float64."""

from __future__ import annotations

import pytest
import torch

from kestrel import ops
from kestrel.kernels.attention import paged_attention_ref
from kestrel.kernels.cpu import attention as cpu_attention
from kestrel.kernels.cpu import native
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


# ------------------------------------------------------------------------------- the C kernel (paged_attention.c)

needs_compiler = pytest.mark.skipif(native.find_compiler() is None, reason="no C compiler")


def _run_native(q, kc, vc, qsl, lens, tables, scale, window=None, k_scale=1.0, v_scale=1.0,
                soft_cap=None) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    assert cpu_attention._native(q, kc, vc, qsl, lens, tables, scale, window, k_scale, v_scale, out, soft_cap, None)
    return out


NATIVE_CASES = {
    "decode": ([1] * 6, [1, 16, 17, 50, 3, 130]),
    "prefill": ([20, 45, 100], [20, 45, 130]),  # whole prompts and a chunk after 30 cached tokens
    "mixed": MIXED,
    "long_chunk": ([70, 1, 33], [300, 257, 48]),
}


@needs_compiler
@pytest.mark.parametrize("case", sorted(NATIVE_CASES))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 4), (6, 1), (12, 4)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (40, 4.0), (None, 30.0)])
def test_native_matches_float64_reference(case: str, num_heads: int, num_kv_heads: int, window: int | None,
                                          soft_cap: float | None) -> None:
    q, kc, vc, qsl, lens, tables = _case(*NATIVE_CASES[case], num_heads, num_kv_heads, 64, seed=3)
    got = _run_native(q, kc, vc, qsl, lens, tables, 0.125, window, soft_cap=soft_cap)
    want = _oracle(q, kc, vc, qsl, lens, tables, 0.125, sliding_window=window, logit_soft_cap=soft_cap)
    torch.testing.assert_close(got.double(), want, atol=3e-6, rtol=3e-6)


@needs_compiler
@pytest.mark.parametrize("head_size", [16, 40, 128, 256])
@pytest.mark.parametrize("case", ["decode", "long_chunk"])
def test_native_head_sizes(head_size: int, case: str) -> None:
    q, kc, vc, qsl, lens, tables = _case(*NATIVE_CASES[case], 8, 2, head_size, seed=4)
    got = _run_native(q, kc, vc, qsl, lens, tables, head_size ** -0.5)
    torch.testing.assert_close(got.double(), _oracle(q, kc, vc, qsl, lens, tables, head_size ** -0.5),
                               atol=3e-6, rtol=3e-6)


@needs_compiler
@pytest.mark.parametrize("case", ["decode", "mixed", "long_chunk"])
def test_native_bf16_cache_and_scales(case: str) -> None:
    """A bf16 cache under float32 queries: widened exactly, so only float32 summation order differs."""
    q, kc, vc, qsl, lens, tables = _case(*NATIVE_CASES[case], 8, 2, 64, cache_dtype=torch.bfloat16, seed=5)
    got = _run_native(q, kc, vc, qsl, lens, tables, 0.2, 33, k_scale=0.5, v_scale=3.0, soft_cap=5.0)
    want = _oracle(q, kc, vc, qsl, lens, tables, 0.2, sliding_window=33, k_scale=0.5, v_scale=3.0,
                   logit_soft_cap=5.0)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=3e-6)


@needs_compiler
@pytest.mark.parametrize("case", ["decode", "long_chunk"])
def test_native_group_wider_than_a_row_tile(case: str) -> None:
    """40 query heads on one KV head: each work item is one query row of the group (more than 32 packed rows)."""
    q, kc, vc, qsl, lens, tables = _case(*NATIVE_CASES[case], 40, 1, 32, seed=8)
    got = _run_native(q, kc, vc, qsl, lens, tables, 0.2, 50)
    torch.testing.assert_close(got.double(), _oracle(q, kc, vc, qsl, lens, tables, 0.2, sliding_window=50),
                               atol=3e-6, rtol=3e-6)


@needs_compiler
def test_native_block_size_32_and_int64_metadata() -> None:
    q, kc, vc, qsl, lens, tables = _case(*MIXED, 4, 2, 64, seed=6)
    # the same keys regrouped as 32-token blocks: pairs of 16-token blocks laid out together
    width = -(-tables.shape[1] // 2)
    kc2 = torch.empty(kc.shape[0] * len(lens), 32, 2, 64)
    vc2 = torch.empty_like(kc2)
    tables2 = torch.full((len(lens), width), -1, dtype=torch.int64)
    for s, ctx in enumerate(lens.tolist()):
        for b in range(-(-ctx // 32)):
            slot = s * kc.shape[0] + b
            for half in range(2):
                src = tables[s, 2 * b + half].item() if 2 * b + half < tables.shape[1] else -1
                if src >= 0:
                    kc2[slot, 16 * half:16 * half + 16] = kc[src]
                    vc2[slot, 16 * half:16 * half + 16] = vc[src]
            tables2[s, b] = slot
    got = _run_native(q, kc2, vc2, qsl.long(), lens.long(), tables2, 0.3)
    torch.testing.assert_close(got.double(), _oracle(q, kc, vc, qsl, lens, tables, 0.3), atol=3e-6, rtol=3e-6)


@needs_compiler
def test_native_result_does_not_depend_on_threads() -> None:
    """One work item is one thread's: the sums' order, hence the result, is the same at any thread count."""
    q, kc, vc, qsl, lens, tables = _case(*NATIVE_CASES["long_chunk"], 8, 2, 64, seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run_native(q, kc, vc, qsl, lens, tables, 0.125)
        torch.set_num_threads(2)
        two = _run_native(q, kc, vc, qsl, lens, tables, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_compiler
def test_paged_attention_cpu_takes_the_native_path_when_it_applies(monkeypatch) -> None:
    q, kc, vc, qsl, lens, tables = _case(*MIXED, 4, 2, 32)
    taken: list[bool] = []
    native_fn = cpu_attention._native
    monkeypatch.setattr(cpu_attention, "_native", lambda *a: taken.append(native_fn(*a)) or taken[-1])
    paged_attention_cpu(q, kc, vc, qsl, lens, tables, 0.2)  # float32
    paged_attention_cpu(q, kc.bfloat16(), vc.bfloat16(), qsl, lens, tables, 0.2)  # bf16 cache
    paged_attention_cpu(q, kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), qsl, lens, tables, 0.2)
    paged_attention_cpu(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), qsl, lens, tables, 0.2)  # bf16 queries
    ends = (torch.arange(q.shape[0]) + 1).to(torch.int32)
    paged_attention_cpu(q, kc, vc, qsl, lens, tables, 0.2, causal_ends=ends)
    assert taken == [True, True, False, False, False]


def test_without_a_compiler_the_torch_path_runs(monkeypatch, tmp_path) -> None:
    assert native.load(compiler=None, find=False, cache_dir=tmp_path) is None
    assert native.load(compiler=str(tmp_path / "no-such-cc"), cache_dir=tmp_path) is None
    monkeypatch.setattr(native, "paged_attention_fn", lambda: None)
    q, kc, vc, qsl, lens, tables = _case(*MIXED, 8, 2, 32)
    got = paged_attention_cpu(q, kc, vc, qsl, lens, tables, 0.2, 9)
    torch.testing.assert_close(got.double(), _oracle(q, kc, vc, qsl, lens, tables, 0.2, sliding_window=9),
                               atol=2e-6, rtol=2e-6)


@needs_compiler
def test_a_source_that_does_not_compile_gives_no_library(tmp_path) -> None:
    bad = tmp_path / "broken.c"
    bad.write_text("int f( {\n")
    assert native.load(source=bad, cache_dir=tmp_path / "cache") is None
    assert not [p for p in (tmp_path / "cache").iterdir() if p.suffix in (".so", ".tmp")]


@needs_compiler
def test_the_library_is_built_once_and_reused(tmp_path) -> None:
    first = native.build(native.SOURCE, native.find_compiler(), tmp_path)
    assert first is not None and first.parent == tmp_path
    mtime = first.stat().st_mtime_ns
    assert native.build(native.SOURCE, native.find_compiler(), tmp_path) == first
    assert first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


@needs_compiler
def test_native_declines_a_table_that_does_not_cover_its_sequences() -> None:
    """A table row shorter than its sequence's blocks, or a block id outside the cache: the kernel writes nothing and
    the call is left to the PyTorch path."""
    q, kc, vc, qsl, lens, tables = _case([1, 1], [40, 5], 4, 2, 16)
    out = torch.full_like(q, 7.0)
    assert not cpu_attention._native(q, kc, vc, qsl, lens, tables[:, :2].contiguous(), 0.3, None, 1.0, 1.0, out,
                                      None, None)
    bad = tables.clone()
    bad[1, 0] = kc.shape[0]
    assert not cpu_attention._native(q, kc, vc, qsl, lens, bad, 0.3, None, 1.0, 1.0, out, None, None)
    assert torch.equal(out, torch.full_like(q, 7.0))
