"""Debug count of kernel launches in one decoder layer's decode step (`LLM(..., debug_launch_count=True)`).

On CUDA the count is exact: CUDA kernel events recorded by `torch.profiler` (Triton kernels included). On CPU
there are no kernels, so the count is a proxy: each `kestrel.ops` call counts once (its Triton kernel; the CPU
reference behind it is many ATen ops), and every other ATen operator that computes counts once (views and
other metadata-only operators excluded), which is what eager PyTorch would launch on a GPU for the same code.
Attention on the GPU adds a split-merge launch for long contexts, which the CPU count does not see.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from kestrel import ops
from kestrel.model.attn_metadata import AttentionMetadata

_OPS = ("paged_attention", "store_kv", "rope_store_kv", "rms_norm", "layer_norm", "act_mul", "act",
        "scaled_mm", "scaled_mm_gated", "quant_fp8_per_token", "quant_int8_per_token", "quant_static",
        "rms_norm_quant", "act_mul_quant", "act_quant")

# Operators that only reinterpret or alias memory: no kernel on a GPU.
_METADATA_ONLY = frozenset({
    "view", "_unsafe_view", "reshape", "alias", "as_strided", "slice", "select", "split", "split_with_sizes",
    "chunk", "narrow", "unsqueeze", "squeeze", "expand", "permute", "transpose", "t", "detach", "unbind",
    "lift_fresh", "empty", "empty_like", "empty_strided", "_reshape_alias", "unflatten", "flatten",
    "view_as", "expand_as", "unsafe_split",
})


class _AtenCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.overloadpacket.__name__ not in _METADATA_ONLY:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _ops_count_once(counter: _AtenCounter) -> Iterator[None]:
    """Each `kestrel.ops` call counts as one launch, whatever its CPU reference does inside."""
    originals = {name: getattr(ops, name) for name in _OPS}

    def once(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            counter.count += 1
            counter.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.paused -= 1
        return wrapper

    try:
        for name, fn in originals.items():
            setattr(ops, name, once(fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(ops, name, fn)


def count_launches(fn: Callable[[], object], device: torch.device) -> int:
    """Launches of one call of `fn` (run once beforehand so compilation and caches stay out of the count)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)
    counter = _AtenCounter()
    with _ops_count_once(counter), counter:
        fn()
    return counter.count


def decode_step_inputs(num_tokens: int, hidden_size: int, dtype: torch.dtype,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """positions, hidden states, residual and metadata of a decode batch whose rows write nowhere (slot -1)."""
    g = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, generator=g, device=device).to(dtype)
    residual = torch.randn(num_tokens, hidden_size, generator=g, device=device).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=device),
        seq_lens=torch.ones(num_tokens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(num_tokens, 1, dtype=torch.int32, device=device),
        max_query_len=1, max_seq_len=1,
    )
    return torch.zeros(num_tokens, dtype=torch.int64, device=device), hidden, residual, meta


def decoder_layer_launches(layer: torch.nn.Module, hidden_size: int, dtype: torch.dtype,
                           device: torch.device, num_tokens: int = 1) -> int:
    """Launches of one decode step through `layer` (a decoder layer called as
    `layer(positions, hidden, residual, attn_metadata)`), with its KV cache already bound."""
    positions, hidden, residual, meta = decode_step_inputs(num_tokens, hidden_size, dtype, device)
    with torch.inference_mode():
        return count_launches(lambda: layer(positions, hidden, residual, meta), device)
