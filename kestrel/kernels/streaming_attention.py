"""Attention over attention sinks plus a sliding window, with positions inside the cache (StreamingLLM).

A query at position v (a position of the cache sequence: the positions the paged cache holds, counted without the
blocks already dropped out of the window) reads the first `sink_tokens` positions and the last `window` ones,
`max(sink_tokens, v - window + 1) .. v`. Rotary positions are those of the cache as the query sees it: sink s sits
at s, the window's first key at `sink_tokens`, the query at `min(v, sink_tokens + window - 1)`, its own index.
Keys are therefore cached un-rotated and rotated here, as they are read: a key's cache index changes each time
the window slides.

Within the window the distance between a query and a key is the same in the cache as in the sequence (the window
has no gap), so its scores only need q and k rotated by any common offset; the sinks' distance to the query does
not follow the sequence. The batched version uses that: the window's keys are rotated once per sequence by
`position - offset` (the offset: the slide of the sequence's last query; a chunk longer than the sinks makes some
of those negative, read through cos(-x) = cos(x), sin(-x) = -sin(x)), the query twice, once for the window and once
for the sinks at its own cache index.

Layout as `paged_attention`: q `[T, H, D]`, caches `[num_blocks, block_size, H_kv, D]` (float or float8_e4m3fn,
stored = value / scale), `query_start_loc` int32 `[S+1]`, `seq_lens` int32 `[S]` (the query rows are each
sequence's last positions), `block_tables` int32 `[S, max_blocks]`; `cos_cache` / `sin_cache` `[positions,
rotary_dim // 2]` (neox halves), None for a model without rotary embeddings.
"""

from __future__ import annotations

import torch

from kestrel.kernels.rope_kv import _rotate_ref


def _check(sink_tokens: int, window: int, logit_soft_cap: float | None) -> None:
    if sink_tokens < 0 or window < 1:
        raise ValueError(f"sink_tokens={sink_tokens} must be >= 0 and window={window} >= 1")
    if logit_soft_cap is not None and logit_soft_cap <= 0:
        raise ValueError(f"logit_soft_cap={logit_soft_cap} must be > 0 or None")


def _rotate(x: torch.Tensor, index: torch.Tensor, cos_cache: torch.Tensor | None, sin_cache: torch.Tensor | None,
            rotary_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """x `[N, heads, D]` rotated by the signed integer positions `index` `[N]`, in `dtype` `[N, heads, D]`."""
    if cos_cache is None or sin_cache is None or index.numel() == 0:
        return x.to(dtype)
    magnitude = index.abs()
    if int(magnitude.max()) >= cos_cache.shape[0]:
        raise ValueError(f"rotary position {int(magnitude.max())} is past the {cos_cache.shape[0]}-row cos/sin tables")
    cos = cos_cache.index_select(0, magnitude).to(dtype).unsqueeze(1)
    sin = (sin_cache.index_select(0, magnitude).to(dtype) * index.sign().to(dtype).unsqueeze(1)).unsqueeze(1)
    if dtype == torch.float64:
        x = x.double()
        half = rotary_dim // 2
        x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
    return _rotate_ref(x, cos, sin, rotary_dim, x.shape[-1]).to(dtype)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Positions 0 .. length - 1 of one sequence's blocks, `[length, H_kv, D]` in `dtype`, times the FP8 scale."""
    block_size = cache.shape[1]
    rows = cache.index_select(0, blocks[: -(-length // block_size)].long().clamp(min=0))
    x = rows.reshape(-1, *cache.shape[2:])[:length].to(dtype)
    return x * scale if scale != 1.0 else x


def _attend(scores: torch.Tensor, allowed: torch.Tensor, values: torch.Tensor, scale: float,
            logit_soft_cap: float | None) -> torch.Tensor:
    """scores `[H, Lq, Lk]` (unscaled), allowed `[Lq, Lk]`, values `[H, Lk, D]` -> `[Lq, H, D]`."""
    scores = scores * scale
    if logit_soft_cap is not None:
        scores = torch.tanh(scores / logit_soft_cap) * logit_soft_cap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values).transpose(0, 1)


def streaming_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sink_tokens: int,
    window: int,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    rotary_dim: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    logit_soft_cap: float | None = None,
) -> torch.Tensor:
    """One query at a time: its context (sinks, then window) laid out as the cache it sees, keys rotated by their
    index in it, q by its own. float32, or float64 for float64 queries."""
    _check(sink_tokens, window, logit_soft_cap)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if out is None:
        out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, length in enumerate(lens):
        start, end = starts[s], starts[s + 1]
        if end == start:
            continue
        keys = _gather(k_cache, block_tables[s], length, k_scale, dtype).repeat_interleave(group, dim=1)
        values = _gather(v_cache, block_tables[s], length, v_scale, dtype).repeat_interleave(group, dim=1)
        for row in range(start, end):
            position = length - (end - row)
            context = list(range(min(sink_tokens, position + 1))) + list(
                range(max(sink_tokens, position - window + 1), position + 1))
            index = torch.tensor(context, dtype=torch.long, device=q.device)
            cache_index = torch.arange(len(context), device=q.device)
            k = _rotate(keys.index_select(0, index), cache_index, cos_cache, sin_cache, rotary_dim, dtype)
            q_row = _rotate(q[row: row + 1], cache_index[-1:], cos_cache, sin_cache, rotary_dim, dtype)
            scores = torch.einsum("qhd,khd->hqk", q_row, k)
            allowed = torch.ones(1, len(context), dtype=torch.bool, device=q.device)
            res = _attend(scores, allowed, values.index_select(0, index).transpose(0, 1), scale, logit_soft_cap)
            out[row] = res[0].to(out.dtype)
    return out


def streaming_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sink_tokens: int,
    window: int,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    rotary_dim: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    logit_soft_cap: float | None = None,
) -> torch.Tensor:
    """`streaming_attention_ref` with one pass per sequence: every query row of a sequence in two matmuls (sinks,
    window), GQA by repeating the KV heads. float32 on any device; it reads the batch's lengths on the host."""
    _check(sink_tokens, window, logit_soft_cap)
    if out is None:
        out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    device, dtype = q.device, torch.float32
    for s, length in enumerate(lens):
        start, end = starts[s], starts[s + 1]
        num_queries = end - start
        if num_queries == 0:
            continue
        keys = _gather(k_cache, block_tables[s], length, k_scale, dtype)
        values = _gather(v_cache, block_tables[s], length, v_scale, dtype).repeat_interleave(group, dim=1)
        positions = torch.arange(length - num_queries, length, device=device)  # [Lq]
        key_positions = torch.arange(length, device=device)  # [Lk]
        slide = (positions - window + 1 - sink_tokens).clamp(min=0)  # how far each query's window has moved
        num_sinks = min(sink_tokens, length)
        offset = int(slide[-1])
        q_window = _rotate(q[start:end], positions - offset, cos_cache, sin_cache, rotary_dim, dtype)
        k_window = _rotate(keys[num_sinks:], key_positions[num_sinks:] - offset, cos_cache, sin_cache, rotary_dim,
                           dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_window, k_window)
        if num_sinks:
            q_sink = _rotate(q[start:end], positions - slide, cos_cache, sin_cache, rotary_dim, dtype)
            k_sink = _rotate(keys[:num_sinks], key_positions[:num_sinks], cos_cache, sin_cache, rotary_dim,
                             dtype).repeat_interleave(group, dim=1)
            scores = torch.cat((torch.einsum("qhd,khd->hqk", q_sink, k_sink), scores), dim=-1)
        query, key = positions.unsqueeze(1), key_positions.unsqueeze(0)
        allowed = (key <= query) & ((key < sink_tokens) | (key > query - window))
        out[start:end] = _attend(scores, allowed, values.transpose(0, 1), scale, logit_soft_cap).to(out.dtype)
    return out
