"""Size and allocate the per-layer paged KV cache tensors."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from safetensors import safe_open

from kestrel.config import CacheConfig, ConfigError, EngineConfig
from kestrel.loader.safetensors import CheckpointNotFoundError, checkpoint_files, iterate_files, weight_format

logger = logging.getLogger(__name__)

FP8_E4M3_MAX = 448.0
# Per-layer FP8 KV scales as checkpoints name them: `self_attn.k_scale` (compressed-tensors, vLLM),
# `self_attn.attn.k_scale`, and the older `self_attn.k_proj.output_scale`.
_KV_SCALE_NAMES = (re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale$"),
                   re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_proj\.output_scale$"))


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * element


def kv_cache_dtype(cache_config: CacheConfig, model_dtype: torch.dtype) -> torch.dtype:
    return torch.float8_e4m3fn if cache_config.kv_cache_dtype == "fp8" else model_dtype


def gpu_kv_cache_budget(total_bytes: int, peak_bytes: int, utilization: float) -> int:
    """Bytes left for the KV cache when the process may use `utilization` of the GPU and the profiling
    forward pass peaked at `peak_bytes` (weights, activations and non-torch memory together)."""
    return int(total_bytes * utilization) - peak_bytes


def num_blocks_for(config: EngineConfig, spec: KVCacheSpec, budget: int | None = None,
                   extra_bytes_per_block: int = 0) -> int:
    """Blocks that fit the memory budget, capped at what max_num_seqs full-length sequences could use.
    `extra_bytes_per_block`: a draft proposer's K/V, which lives in the same blocks.

    Budget precedence: `kv_cache_blocks`, then `kv_cache_memory_bytes`, then the given `budget` (the GPU's
    profiled one), then `cpu_kv_cache_bytes`."""
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    max_len = config.model.max_model_len or 0
    useful = config.scheduler.max_num_seqs * -(-max_len // spec.block_size)
    if config.cache.kv_cache_memory_bytes is not None:
        budget = config.cache.kv_cache_memory_bytes
    elif budget is None:
        budget = config.cache.cpu_kv_cache_bytes
    bytes_per_block = spec.bytes_per_block + extra_bytes_per_block
    fitting = budget // bytes_per_block
    if fitting < 1:
        raise ConfigError(f"no room for the KV cache: one block needs {bytes_per_block} bytes and the budget is "
                          f"{max(budget, 0)} bytes; raise gpu_memory_utilization / kv_cache_memory_bytes / "
                          "cpu_kv_cache_bytes or set kv_cache_blocks")
    return int(min(fitting, max(useful, 1)))


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """One `[2, num_blocks, block_size, num_kv_heads, head_size]` tensor per layer (K then V)."""
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]


def checkpoint_kv_scales(model_dir: str, num_layers: int) -> list[tuple[float, float]] | None:
    """Per-layer (k_scale, v_scale) stored in the checkpoint, or None when it has none. A layer that has
    only one of the two keeps 1.0 for the other."""
    fmt = weight_format(model_dir)
    try:
        files = checkpoint_files(model_dir, fmt or "safetensors")
    except CheckpointNotFoundError:
        return None
    found: dict[int, dict[str, float]] = {}

    def record(name: str, read: Callable[[], torch.Tensor]) -> None:
        for pattern in _KV_SCALE_NAMES:
            m = pattern.match(name)
            if m and int(m.group(1)) < num_layers:
                found.setdefault(int(m.group(1)), {})[m.group(2)] = float(read().float().max())

    if fmt == "pt":
        for name, tensor in iterate_files(files, "pt"):
            record(name, lambda tensor=tensor: tensor)
    for path in files if fmt != "pt" else []:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                record(name, lambda f=f, name=name: f.get_tensor(name))
    if not found:
        return None
    return [(found.get(i, {}).get("k", 1.0), found.get(i, {}).get("v", 1.0)) for i in range(num_layers)]


def kv_cache_scales(config: EngineConfig, layers: Sequence[int]) -> list[tuple[float, float]]:
    """(k_scale, v_scale) of each of `layers` (model layer indices: a pipeline stage's own): 1.0 for a 16-bit
    cache; for FP8 the checkpoint's, else 1.0 with a warning (ModelRunner.calibrate_kv_scales measures them)."""
    num_layers = len(layers)
    declared = bool((config.model.hf_config.get("quantization_config") or {}).get("kv_cache_scheme"))
    if config.cache.kv_cache_dtype != "fp8":
        if declared:
            logger.info("the checkpoint carries FP8 KV cache scales (kv_cache_scheme); kv_cache_dtype='fp8' uses them")
        return [(1.0, 1.0)] * num_layers
    total = max(layers, default=-1) + 1
    scales = None if config.model.load_format == "dummy" else checkpoint_kv_scales(config.model.model, total)
    if scales is None and declared:
        raise ConfigError("invalid checkpoint: its quantization_config declares a kv_cache_scheme but no layer has "
                          "k_scale / v_scale tensors; re-export it or drop kv_cache_scheme")
    if scales is None:
        logger.warning("kv_cache_dtype='fp8' but the checkpoint has no KV cache scales: using k_scale = v_scale "
                       "= 1.0, so K/V values beyond +-%g saturate; ModelRunner.calibrate_kv_scales() measures "
                       "scales from a calibration run", FP8_E4M3_MAX)
        return [(1.0, 1.0)] * num_layers
    return [scales[i] for i in layers]
