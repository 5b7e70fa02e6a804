"""Write K and V into the paged cache by slot mapping (slot -1 writes nothing)."""

from __future__ import annotations

import torch


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value `[num_tokens, num_kv_heads, head_size]` into caches `[num_blocks, block_size, H_kv, D]`.

    An FP8 cache stores value / scale, saturated to the e4m3 range.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat[slots] = _to_cache_dtype(key[valid], k_cache.dtype, k_scale)
    v_flat[slots] = _to_cache_dtype(value[valid], v_cache.dtype, v_scale)


def _to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype == torch.float8_e4m3fn:
        limit = torch.finfo(torch.float8_e4m3fn).max
        return (x.float() / scale).clamp(-limit, limit).to(dtype)
    return x.to(dtype)
