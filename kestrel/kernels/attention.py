"""Paged attention over a flat batch mixing prefill chunks and decodes.

Cache layout per layer: `k_cache`, `v_cache` are `[num_blocks, block_size, num_kv_heads, head_size]`
(bf16/fp16/fp32, or float8_e4m3fn with per-tensor `k_scale`/`v_scale`: stored = value / scale).
"""

from __future__ import annotations

import torch


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: q `[num_tokens, num_heads, head_size]` -> out of the same shape and dtype.

    Query row i of a sequence with context length L and query length Lq sits at position
    L - Lq + i and attends to keys at positions p with p <= its position (and, with a sliding
    window W, p > position - W). Computed in float32 (float64 if q is float64).
    """
    num_tokens, num_heads, head_size = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[s, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].to(compute_dtype) * k_scale
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].to(compute_dtype) * v_scale
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        qs = q[q_start:q_end].to(compute_dtype)  # [Lq, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
