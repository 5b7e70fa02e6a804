"""paged_attention_ref against a dense float64 oracle; store_kv_ref slot handling."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels.attention import paged_attention_ref
from kestrel.kernels.store_kv import store_kv_ref

BLOCK_SIZE = 4
HEAD_SIZE = 8
NUM_HEADS = 4
NUM_BLOCKS = 40

# (context length after the step, query tokens in the step): prefill, prefill chunk after cached
# context, decodes, a sequence with nothing scheduled, a one-token prompt.
SEQS = [(13, 13), (22, 7), (9, 1), (30, 1), (6, 0), (1, 1), (17, 16)]


def dense_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float,
                 window: int | None) -> torch.Tensor:
    """Plain causal attention in float64 over one sequence's contiguous K/V, head by head."""
    query_len, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(query_len):
        pos = context_len - query_len + i
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(num_heads):
            keys = k[lo : pos + 1, h // group].double()
            values = v[lo : pos + 1, h // group].double()
            weights = torch.softmax(keys @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ values
    return out


def build_case(num_kv_heads: int, dtype: torch.dtype, seed: int = 0):
    """Random per-sequence K/V written through store_kv_ref into blocks scattered over the cache."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_SIZE, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free_blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    max_blocks = max(-(-ctx // BLOCK_SIZE) for ctx, _ in SEQS) + 2
    block_tables = torch.zeros(len(SEQS), max_blocks, dtype=torch.int32)  # padding 0 is a real block of another seq
    keys, values, queries = [], [], []
    for s, (ctx, _) in enumerate(SEQS):
        blocks = [free_blocks.pop() for _ in range(-(-ctx // BLOCK_SIZE))]
        block_tables[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(ctx, num_kv_heads, HEAD_SIZE, generator=g).to(dtype)
        v = torch.randn(ctx, num_kv_heads, HEAD_SIZE, generator=g).to(dtype)
        slots = torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx)])
        store_kv_ref(k, v, k_cache, v_cache, slots)
        keys.append(k)
        values.append(v)
    query_lens = [n for _, n in SEQS]
    for n in query_lens:
        queries.append(torch.randn(n, NUM_HEADS, HEAD_SIZE, generator=g).to(dtype))
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([ctx for ctx, _ in SEQS], dtype=torch.int32)
    return torch.cat(queries), keys, values, k_cache, v_cache, query_start_loc, seq_lens, block_tables


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_paged_attention_matches_dense_oracle(num_kv_heads: int, window: int | None, dtype: torch.dtype) -> None:
    q, keys, values, k_cache, v_cache, qsl, seq_lens, block_tables = build_case(num_kv_heads, dtype)
    scale = HEAD_SIZE**-0.5
    out = paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, block_tables, scale, sliding_window=window)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    for s, (ctx, _) in enumerate(SEQS):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        expected = dense_oracle(q[rows], keys[s], values[s], ctx, scale, window)
        torch.testing.assert_close(out[rows].double(), expected, rtol=tol, atol=tol)


def test_sliding_window_changes_the_result() -> None:
    """Guards the window test above against a window that never excludes anything."""
    q, _, _, k_cache, v_cache, qsl, seq_lens, block_tables = build_case(2, torch.float64)
    full = paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, block_tables, 0.3)
    windowed = paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, block_tables, 0.3, sliding_window=5)
    assert (full - windowed).abs().max() > 1e-3


def test_paged_attention_writes_into_out() -> None:
    q, _, _, k_cache, v_cache, qsl, seq_lens, block_tables = build_case(2, torch.float32)
    out = torch.full_like(q, float("nan"))
    result = paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, block_tables, 0.3, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all()


def test_store_kv_skips_slot_minus_one() -> None:
    k_cache = torch.zeros(3, BLOCK_SIZE, 2, HEAD_SIZE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(4, 2, HEAD_SIZE)
    value = torch.randn(4, 2, HEAD_SIZE)
    slots = torch.tensor([5, -1, 0, -1])
    store_kv_ref(key, value, k_cache, v_cache, slots)
    k_flat = k_cache.view(-1, 2, HEAD_SIZE)
    v_flat = v_cache.view(-1, 2, HEAD_SIZE)
    torch.testing.assert_close(k_flat[5], key[0])
    torch.testing.assert_close(v_flat[0], value[2])
    written = torch.zeros(k_flat.shape[0], dtype=torch.bool)
    written[[0, 5]] = True
    assert (k_flat[~written] == 0).all() and (v_flat[~written] == 0).all()


def test_store_kv_all_padding_writes_nothing() -> None:
    k_cache = torch.zeros(2, BLOCK_SIZE, 1, HEAD_SIZE)
    v_cache = torch.zeros_like(k_cache)
    store_kv_ref(torch.ones(3, 1, HEAD_SIZE), torch.ones(3, 1, HEAD_SIZE), k_cache, v_cache,
                 torch.full((3,), -1))
    assert (k_cache == 0).all() and (v_cache == 0).all()
