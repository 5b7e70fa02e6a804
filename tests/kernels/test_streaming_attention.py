"""Attention sinks + window with positions inside the cache (kernels/streaming_attention.py) against a float64
oracle that lays out each query's cache (sinks, then window) from contiguous K/V and rotates by cache index."""

from __future__ import annotations

import math

import pytest
import torch

from kestrel import ops
from kestrel.kernels.attention import paged_attention_ref
from kestrel.kernels.streaming_attention import streaming_attention, streaming_attention_ref

BLOCK = 4


def _tables(max_position: int, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def _rotate64(x: torch.Tensor, position: int, rotary_dim: int) -> torch.Tensor:
    """x `[heads, D]` float64, neox halves rotated by `position` (angles in float64)."""
    half = rotary_dim // 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    cos, sin = torch.cos(position * inv_freq), torch.sin(position * inv_freq)
    x1, x2, rest = x[:, :half], x[:, half:rotary_dim], x[:, rotary_dim:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def _oracle(q, keys, values, lens, q_lens, scale, sinks, window, rotary_dim, soft_cap=None):
    """Per sequence contiguous keys/values `[L, H_kv, D]`; returns float64 `[T, H, D]`."""
    rows = []
    for s, (length, q_len) in enumerate(zip(lens, q_lens)):
        group = q[0].shape[0] // keys[s].shape[1]
        for i in range(q_len):
            v = length - q_len + i
            context = [u for u in range(length) if u <= v and (u < sinks or u > v - window)]
            k = torch.stack([_rotate64(keys[s][u].double(), c, rotary_dim) for c, u in enumerate(context)])
            qv = _rotate64(q[sum(q_lens[:s]) + i].double(), len(context) - 1, rotary_dim)
            k = k.repeat_interleave(group, dim=1)  # [K, H, D]
            vals = values[s][context].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,khd->hk", qv, k) * scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            rows.append(torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), vals))
    return torch.stack(rows)


def _paged(keys, values, num_blocks, seed):
    """Scatter each sequence's K/V into shuffled blocks of a NaN-filled cache."""
    gen = torch.Generator().manual_seed(seed)
    h_kv, d = keys[0].shape[1:]
    k_cache = torch.full((num_blocks, BLOCK, h_kv, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for k, v in zip(keys, values):
        ids = [free.pop() for _ in range(math.ceil(len(k) / BLOCK))]
        for j, block in enumerate(ids):
            n = min(BLOCK, len(k) - j * BLOCK)
            k_cache[block, :n], v_cache[block, :n] = k[j * BLOCK: j * BLOCK + n], v[j * BLOCK: j * BLOCK + n]
        tables.append(ids)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [num_blocks - 1] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, table


@pytest.mark.parametrize("sinks,window,group,rotary_dim,soft_cap", [
    (4, 8, 1, 16, None), (3, 5, 4, 16, None), (0, 7, 2, 16, None), (5, 6, 2, 8, None), (2, 9, 1, 16, 3.0),
])
def test_against_float64_oracle(sinks: int, window: int, group: int, rotary_dim: int, soft_cap: float | None) -> None:
    torch.manual_seed(sinks * 31 + window)
    h_kv, d = 2, 16
    # decodes far past sinks + window, a prefill from 0, chunks longer and shorter than the sinks, a 1-token context
    lens, q_lens = [40, 23, 31, 1, 17, 50], [1, 23, 9, 1, 2, 3]
    keys = [torch.randn(n, h_kv, d) for n in lens]
    values = [torch.randn(n, h_kv, d) for n in lens]
    q = torch.randn(sum(q_lens), h_kv * group, d)
    k_cache, v_cache, table = _paged(keys, values, 64, seed=window)
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cos, sin = _tables(64, rotary_dim)
    scale = d ** -0.5
    expected = _oracle(q, keys, values, lens, q_lens, scale, sinks, window, rotary_dim, soft_cap)
    args = (k_cache, v_cache, starts, seq_lens, table, scale, sinks, window, cos, sin, rotary_dim)
    fast = streaming_attention(q, *args, logit_soft_cap=soft_cap)
    ref = streaming_attention_ref(q.double(), *args, logit_soft_cap=soft_cap)
    torch.testing.assert_close(fast.double(), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)  # float32 cos/sin tables: ~1e-7 off
    torch.testing.assert_close(ops.streaming_attention(q, *args, logit_soft_cap=soft_cap), fast)


def test_fp8_cache_scales() -> None:
    torch.manual_seed(0)
    lens, q_lens = [30, 12], [1, 12]
    keys = [torch.randn(n, 1, 16) for n in lens]
    values = [torch.randn(n, 1, 16) for n in lens]
    k_scale, v_scale = 0.02, 0.03
    k8 = [(k / k_scale).to(torch.float8_e4m3fn) for k in keys]
    v8 = [(v / v_scale).to(torch.float8_e4m3fn) for v in values]
    k_cache, v_cache, table = _paged([k.float() for k in k8], [v.float() for v in v8], 16, seed=1)
    q = torch.randn(sum(q_lens), 2, 16)
    starts = torch.tensor([0, 1, 13], dtype=torch.int32)
    cos, sin = _tables(32, 16)
    out = streaming_attention(q, k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn), starts,
                              torch.tensor(lens, dtype=torch.int32), table, 0.25, 2, 6, cos, sin, 16, k_scale, v_scale)
    expected = _oracle(q, [k.float() * k_scale for k in k8], [v.float() * v_scale for v in v8], lens, q_lens, 0.25, 2,
                       6, 16)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_dense_while_within_sinks_plus_window() -> None:
    """Contexts no longer than sinks + window: plain causal attention over keys rotated by their positions."""
    torch.manual_seed(3)
    lens, q_lens = [12, 9], [5, 1]
    keys = [torch.randn(n, 2, 16) for n in lens]
    values = [torch.randn(n, 2, 16) for n in lens]
    q = torch.randn(sum(q_lens), 4, 16)
    cos, sin = _tables(32, 16)
    k_cache, v_cache, table = _paged(keys, values, 16, seed=2)
    starts = torch.tensor([0, 5, 6], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = streaming_attention(q, k_cache, v_cache, starts, seq_lens, table, 0.25, 4, 8, cos, sin, 16)
    rotated = [torch.stack([_rotate64(k[u].double(), u, 16) for u in range(len(k))]).float() for k in keys]
    positions = [p for n, m in zip(lens, q_lens) for p in range(n - m, n)]
    q_rot = torch.stack([_rotate64(q[i].double(), p, 16) for i, p in enumerate(positions)]).float()
    rk, rv, rtable = _paged(rotated, values, 16, seed=2)
    dense = paged_attention_ref(q_rot, rk, rv, starts, seq_lens, rtable, 0.25)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_rejects_bad_settings() -> None:
    q = torch.zeros(1, 1, 8)
    cache = torch.zeros(2, BLOCK, 1, 8)
    args = (cache, cache, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="window=0"):
        streaming_attention(q, *args, 1, 0, None, None, 0)
    with pytest.raises(ValueError, match="logit_soft_cap"):
        streaming_attention(q, *args, 1, 4, None, None, 0, logit_soft_cap=-1.0)
