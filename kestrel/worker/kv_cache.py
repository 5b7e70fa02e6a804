"""Size and allocate the per-layer paged KV cache tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.config import CacheConfig, ConfigError, EngineConfig


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


def num_blocks_for(config: EngineConfig, spec: KVCacheSpec, device: torch.device) -> int:
    """Blocks that fit the memory budget, capped at what max_num_seqs full-length sequences could use."""
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    max_len = config.model.max_model_len or 0
    useful = config.scheduler.max_num_seqs * -(-max_len // spec.block_size)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free
        budget = int(total * config.cache.gpu_memory_utilization) - in_use
    else:
        budget = config.cache.cpu_kv_cache_bytes
    fitting = budget // spec.bytes_per_block
    if fitting < 1:
        raise ConfigError(f"no room for the KV cache: one block needs {spec.bytes_per_block} bytes and the budget is "
                          f"{max(budget, 0)} bytes; raise gpu_memory_utilization / cpu_kv_cache_bytes or set "
                          "kv_cache_blocks")
    return int(min(fitting, max(useful, 1)))


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """One `[2, num_blocks, block_size, num_kv_heads, head_size]` tensor per layer (K then V)."""
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
