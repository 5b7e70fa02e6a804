"""RoPE of q and k with the paged KV write, and the plain KV write, on the CPU: `rope_store_kv_ref` and
`store_kv_ref` with fewer passes over the activations. The rotation is the reference's arithmetic (fp32
`x1 * cos - x2 * sin`, `x2 * cos + x1 * sin`, rounded once), written into one preallocated tensor instead of
a concatenation; the cache write is one `index_copy_` per cache when every slot is real, the reference's masked
indexing otherwise (rows with slot -1 write nothing). Results are bit-identical to the references.
"""

from __future__ import annotations

import torch

from kestrel.kernels.store_kv import _to_cache_dtype, store_kv_ref


def store_kv_cpu(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """`store_kv_ref`: key/value `[T, H_kv, D]` into caches `[num_blocks, block_size, H_kv, D]` by slot."""
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    for flat, x, scale in ((k_flat, key, k_scale), (v_flat, value, v_scale)):
        x = _to_cache_dtype(x, flat.dtype, scale)
        if flat.dtype == torch.float8_e4m3fn:  # index_copy_ has no FP8 kernel: copy the bytes
            flat, x = flat.view(torch.uint8), x.view(torch.uint8)
        flat.index_copy_(0, slots, x)


def rope_store_kv_cpu(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos_cache: torch.Tensor, sin_cache: torch.Tensor, rotary_dim: int, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
    """`rope_store_kv_ref`: q `[T, H*D]`, k and v `[T, H_kv*D]` -> rotated q `[T, H*D]`, k and v in the caches."""
    num_tokens, head_size = q.shape[0], k_cache.shape[-1]
    cos = cos_cache.index_select(0, positions.long()).float().unsqueeze(1)  # [T, 1, rotary_dim // 2]
    sin = sin_cache.index_select(0, positions.long()).float().unsqueeze(1)
    k_rot = _rotate(k, cos, sin, rotary_dim, head_size, torch.float32)
    store_kv_cpu(k_rot, v.reshape(num_tokens, -1, head_size), k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return _rotate(q, cos, sin, rotary_dim, head_size, q.dtype).reshape(num_tokens, -1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, head_size: int,
            out_dtype: torch.dtype) -> torch.Tensor:
    """`[T, heads, head_size]` rotated in fp32, in `out_dtype`."""
    x = x.reshape(x.shape[0], -1, head_size)
    x32 = x.float()
    half = rotary_dim // 2
    x1, x2 = x32[..., :half], x32[..., half:rotary_dim]
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rotary_dim] = x2 * cos + x1 * sin
    if rotary_dim < head_size:
        out[..., rotary_dim:] = x[..., rotary_dim:]
    return out
