"""The one dispatch point: CUDA tensors go to Triton kernels, everything else to the PyTorch references.

Callers never test the device themselves; they call `kestrel.ops.<op>` with the reference's signature.
"""

from __future__ import annotations

import functools

import torch

from kestrel.kernels import attention as _attention
from kestrel.kernels import store_kv as _store_kv


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and triton_available()


def paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window=None,
                    k_scale=1.0, v_scale=1.0, out=None):
    impl = getattr(_attention, "paged_attention", None) if use_triton(q) else None
    fn = impl or _attention.paged_attention_ref
    return fn(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window,
              k_scale, v_scale, out)


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    impl = getattr(_store_kv, "store_kv", None) if use_triton(key) else None
    fn = impl or _store_kv.store_kv_ref
    fn(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
