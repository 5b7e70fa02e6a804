"""RoPE of q and k with the paged KV write, and the plain KV write, on the CPU: `rope_store_kv_ref` and
`store_kv_ref` with fewer passes over the activations. The rotation is the reference's arithmetic (fp32
`x1 * cos - x2 * sin`, `x2 * cos + x1 * sin`, rounded once), written into one preallocated tensor instead of
a concatenation; the cache write is one `index_copy_` per cache when every slot is real, the reference's masked
indexing otherwise (rows with slot -1 write nothing). Results are bit-identical to the references.

Float32 activations over a float32 or bf16 cache take one pass in C instead (`elementwise.c`'s
`kestrel_rope_store_kv`, the same arithmetic with no fused multiply-adds, so again bit-identical).
"""

from __future__ import annotations

import torch

from kestrel.kernels.cpu import native
from kestrel.kernels.store_kv import _to_cache_dtype, store_kv_ref

_C_CACHE_DTYPES = (torch.float32, torch.bfloat16)


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
    rotated = _rope_store_kv_c(positions, q, k, v, cos_cache, sin_cache, rotary_dim, k_cache, v_cache, slot_mapping)
    if rotated is not None:
        return rotated
    num_tokens, head_size = q.shape[0], k_cache.shape[-1]
    cos = cos_cache.index_select(0, positions.long()).float().unsqueeze(1)  # [T, 1, rotary_dim // 2]
    sin = sin_cache.index_select(0, positions.long()).float().unsqueeze(1)
    k_rot = _rotate(k, cos, sin, rotary_dim, head_size, torch.float32)
    store_kv_cpu(k_rot, v.reshape(num_tokens, -1, head_size), k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return _rotate(q, cos, sin, rotary_dim, head_size, q.dtype).reshape(num_tokens, -1)


def _rope_store_kv_c(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor, rotary_dim: int, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """The C kernel's rotated q, or None where it does not apply (the caller then runs the PyTorch path)."""
    head_size = k_cache.shape[-1]
    if not (q.dtype == k.dtype == v.dtype == torch.float32 and q.dim() == k.dim() == v.dim() == 2
            and q.stride(1) == k.stride(1) == v.stride(1) == 1 and k_cache.dtype in _C_CACHE_DTYPES
            and v_cache.dtype == k_cache.dtype and k_cache.shape == v_cache.shape and k_cache.dim() == 4
            and k_cache.is_contiguous() and v_cache.is_contiguous() and positions.dim() == 1
            and q.shape[1] % head_size == 0 and k.shape[1] == v.shape[1] == k_cache.shape[2] * head_size
            and cos_cache.dim() == 2 and cos_cache.shape == sin_cache.shape
            and cos_cache.shape[1] * 2 == rotary_dim and not (q.requires_grad or k.requires_grad or v.requires_grad)):
        return None
    fn = native.rope_store_kv_fn()
    if fn is None:
        return None
    num_tokens = q.shape[0]
    cos, sin = cos_cache.float().contiguous(), sin_cache.float().contiguous()
    positions, slots = positions.long().contiguous(), slot_mapping.long().contiguous()
    out = torch.empty(num_tokens, q.shape[1], dtype=torch.float32)
    status = fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0], out.data_ptr(),
                k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16), slots.data_ptr(),
                k_cache.shape[0] * k_cache.shape[1], num_tokens, q.shape[1] // head_size, k_cache.shape[2],
                head_size, rotary_dim, torch.get_num_threads())
    return out if status == 0 else None


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
