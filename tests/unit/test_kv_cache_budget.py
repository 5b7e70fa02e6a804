"""KV cache sizing: the profiled GPU budget, the absolute `kv_cache_memory_bytes` and their precedence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kestrel.config import ConfigError, EngineConfig
from kestrel.kv_spec import FullAttentionSpec
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.worker.kv_cache import KVCacheShape, gpu_kv_cache_budget, num_blocks_for

SPEC = KVCacheShape((FullAttentionSpec(num_kv_heads=2, head_size=8),) * 2, dtype=torch.float32, block_size=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kvbudget")
    write_tiny_checkpoint(path, arch="llama", seed=0)
    return path


def test_gpu_budget_is_the_fraction_minus_the_peak() -> None:
    total = 100 * 2**30
    assert gpu_kv_cache_budget(total, 20 * 2**30, 0.9) == 70 * 2**30
    assert gpu_kv_cache_budget(total, 95 * 2**30, 0.9) < 0


def test_budget_precedence(model_dir: Path) -> None:
    per_block = SPEC.bytes_per_block
    config = EngineConfig.from_kwargs(str(model_dir), max_model_len=64, max_num_seqs=1000, max_num_batched_tokens=1000,
                                      cpu_kv_cache_bytes=10 * per_block)
    assert num_blocks_for(config, SPEC) == 10
    assert num_blocks_for(config, SPEC, budget=7 * per_block + 1) == 7
    absolute = config.replace(cache=config.cache.__class__(kv_cache_memory_bytes=3 * per_block))
    assert num_blocks_for(absolute, SPEC, budget=7 * per_block) == 3
    explicit = config.replace(cache=config.cache.__class__(kv_cache_blocks=5, kv_cache_memory_bytes=3 * per_block))
    assert num_blocks_for(explicit, SPEC, budget=7 * per_block) == 5
    with pytest.raises(ConfigError, match="no room for the KV cache"):
        num_blocks_for(config, SPEC, budget=-1)


def test_kv_cache_memory_bytes_is_validated(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes"):
        EngineConfig.from_kwargs(str(model_dir), kv_cache_memory_bytes=0)
    config = EngineConfig.from_kwargs(str(model_dir), kv_cache_memory_bytes=1 << 20)
    assert config.cache.kv_cache_memory_bytes == 1 << 20
