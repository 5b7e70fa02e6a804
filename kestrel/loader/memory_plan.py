"""The memory plan: the bytes a model takes on its device, from its config.json, before anything is allocated.

The model is built on the meta device (shapes and dtypes, no memory: its quantization methods create their real
parameters there), so every parameter and buffer is counted at the dtype it will have; a layer quantized at load
counts its high-precision weight while loading and its 8-bit one after. With the KV cache the worker allocates
once the weights are in (at least one max_model_len sequence), the total is compared with what the device has
free (the host's available memory on the CPU). A model that cannot fit is a ConfigError naming the config.json
fields that drive its size and the bytes needed and available, instead of an allocation that fails (or swaps)
minutes later. The config's sizes are bounded first (`kestrel.config.HF_CONFIG_BOUNDS`), so the meta model has at
most 1,024 layers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kestrel.config import ConfigError
from kestrel.distributed.parallel import ParallelContext
from kestrel.model.layers.linear import LinearBase
from kestrel.model.layers.moe import FusedExperts

# The bytes of the KV cache the worker allocates for a model whose attention layers (on the meta device) these are.
KVCacheBytes = Callable[[Sequence[nn.Module]], int]

# What each part of the plan is made of, by the config.json fields that size it.
_PART_FIELDS: dict[str, tuple[str, ...]] = {
    "embedding and LM head": ("vocab_size", "hidden_size", "tie_word_embeddings"),
    "decoder layers": ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                       "num_key_value_heads", "head_dim"),
    "rotary tables": ("max_position_embeddings", "head_dim"),
    "other weights": ("hidden_size",),
    "KV cache": ("num_hidden_layers", "num_key_value_heads", "head_dim"),
}


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes by part (`_PART_FIELDS`); `loading_bytes`: the weights while loading, `weight_bytes` once processed
    (they differ for layers quantized at load), `kv_bytes` the KV cache allocated after them."""

    parts: dict[str, int]
    loading_bytes: int
    weight_bytes: int
    kv_bytes: int

    @property
    def needed_bytes(self) -> int:
        return max(self.loading_bytes, self.weight_bytes + self.kv_bytes)


def plan_memory(build: Callable[[], nn.Module], kv_cache_bytes: KVCacheBytes | None = None) -> MemoryPlan:
    """The plan of the model `build` makes (called under the meta device), with the KV cache `kv_cache_bytes` gives
    for its attention layers (None: weights only)."""
    with torch.device("meta"):
        model = build()
    parts: dict[str, int] = {}
    loading = kept = 0
    # A weight its quant method changes after loading (quantized at load) is counted as the method plans it. A layer
    # quantized as its random weights are filled holds its high-precision weights until it is processed: the
    # largest such layer's, on top of everything already quantized, is the peak while loading.
    planned: dict[int, tuple[int, int] | None] = {}
    transient = 0
    for module in model.modules():
        weights = _quantizable_weights(module)
        if not weights:
            continue
        plans = [module.quant_method.planned_weight_bytes(weight) for weight in weights]
        planned.update(zip(map(id, weights), plans))
        if module.quant_method.defer_weight and any(plans):
            transient = max(transient, sum(w.numel() * w.element_size() for w in weights))
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        while_loading, size = planned.get(id(param)) or (size, size)
        loading += while_loading
        kept += size
        part = _part_of(name)
        parts[part] = parts.get(part, 0) + size
    for name, buffer in model.named_buffers():
        size = buffer.numel() * buffer.element_size()
        part = "rotary tables" if name.endswith(("cos_cache", "sin_cache")) else "other weights"
        parts[part] = parts.get(part, 0) + size
        loading += size
        kept += size
    kv = 0
    if kv_cache_bytes is not None:
        kv = kv_cache_bytes(model.attention_layers())
        parts["KV cache"] = kv
    return MemoryPlan(parts, loading + transient, kept, kv)


def _quantizable_weights(module: nn.Module) -> list[nn.Parameter]:
    """The weights a layer's quant method may change after loading: a linear layer's, a mixture's stacked experts."""
    if isinstance(module, LinearBase):
        names = ("weight",)
    elif isinstance(module, FusedExperts):
        names = ("w13_weight", "w2_weight")
    else:
        return []
    return [w for w in (getattr(module, name, None) for name in names) if isinstance(w, nn.Parameter)]


def _part_of(name: str) -> str:
    if name.startswith(("model.embed_tokens.", "lm_head.", "embed_tokens.")):
        return "embedding and LM head"
    if ".layers." in name or name.startswith("layers."):
        return "decoder layers"
    return "other weights"


def available_memory(device: str | torch.device) -> tuple[int, str] | None:
    """(bytes a new allocation can take on `device`, where they were counted), or None where it cannot be told
    (the meta device)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    if device.type == "cpu":
        return host_available_memory()
    return None


def host_available_memory() -> tuple[int, str] | None:
    """The host's available memory: /proc/meminfo's MemAvailable (else the free pages), lowered to the headroom
    under a cgroup v2 memory limit."""
    found: list[tuple[int, str]] = []
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "available on the host (MemAvailable)"))
                break
    if not found:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            found.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free on the host"))
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            found.append((max(int(limit) - used, 0), "left under this container's memory limit (cgroup)"))
    return min(found) if found else None


def check_memory_plan(plan: MemoryPlan, hf_config: dict, device: str | torch.device,
                      parallel: ParallelContext | None = None, max_model_len: int | None = None,
                      dtype: torch.dtype | None = None) -> None:
    """ConfigError when `plan` (of a model in `dtype`) needs more than `device` has available."""
    available = available_memory(device)
    if available is None or plan.needed_bytes <= available[0]:
        return
    have, where = available
    rank = ""
    if parallel is not None and parallel.world_size > 1:
        rank = (f" (this rank's share at tensor_parallel_size={parallel.tp_size}, "
                f"pipeline_parallel_size={parallel.pp_size})")
    parts = "; ".join(f"{part} {_size(size)} ({_fields(part, hf_config, max_model_len)})"
                      for part, size in sorted(plan.parts.items(), key=lambda item: -item[1]) if size)
    in_dtype = "" if dtype is None else f" with {str(dtype).removeprefix('torch.')} weights"
    loading = ""
    if plan.loading_bytes > plan.weight_bytes:
        loading = f"; while loading, before quantization, the weights take {_size(plan.loading_bytes)}"
    raise ConfigError(
        f"the model does not fit on {torch.device(device)}: it needs {plan.needed_bytes:,} bytes "
        f"({_size(plan.needed_bytes)}){rank}{in_dtype} and {have:,} bytes ({_size(have)}) are {where}. "
        f"By part: {parts}{loading}. Check those config.json fields, or use a larger tensor_parallel_size / "
        "pipeline_parallel_size, quantization='fp8', or a smaller max_model_len / KV cache")


def _fields(part: str, hf_config: dict, max_model_len: int | None) -> str:
    named = [f"{name}={hf_config[name]}" for name in _PART_FIELDS.get(part, ()) if hf_config.get(name) is not None]
    if part == "KV cache" and max_model_len is not None:
        named.append(f"max_model_len={max_model_len}")
    return ", ".join(named) or "the model's own layers"


def _size(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


__all__ = ["MemoryPlan", "available_memory", "check_memory_plan", "host_available_memory", "plan_memory"]
