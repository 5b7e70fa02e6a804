"""Size and allocate the paged KV cache: one tensor per attention layer, shaped by the layer's KV spec, and the
model's KV-cache groups (layers with one spec share a block table; `kestrel.kv_spec`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from safetensors import safe_open

from kestrel.config import CacheConfig, ConfigError, EngineConfig, SparseDecodeConfig, StreamingWindowConfig
from kestrel.distributed.parallel import ParallelContext
from kestrel.kv_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    LatentAttentionSpec,
    NoKVCacheSpec,
    group_layers,
    layer_group_indices,
)
from kestrel.loader.safetensors import CheckpointNotFoundError, checkpoint_files, iterate_files, weight_format
from kestrel.ops import key_bounds_dtype
from kestrel.quant.scheme import KV_SCALE_NAMES

logger = logging.getLogger(__name__)

FP8_E4M3_MAX = 448.0


class CachingLayer(Protocol):
    """What the KV cache reads of an attention module."""

    layer_idx: int
    prefix: str | None

    @property
    def cache_spec(self) -> KVCacheSpec: ...

    def bind_kv_cache(self, kv_cache: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                      group: int = 0) -> None: ...


@dataclass(frozen=True)
class KVCacheShape:
    """What one rank's attention layers cache: each layer's spec (in `attention_layers()` order), the cache's
    element type and the block size. A block id indexes every layer's cache, so a block costs every layer's
    bytes: the sum over the groups."""

    layer_specs: tuple[KVCacheSpec, ...]
    dtype: torch.dtype
    block_size: int

    @classmethod
    def of_layers(cls, layers: Sequence[CachingLayer], dtype: torch.dtype, block_size: int) -> KVCacheShape:
        return cls(tuple(layer.cache_spec for layer in layers), dtype, block_size)

    @property
    def num_layers(self) -> int:
        return len(self.layer_specs)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        element = self.element_size
        return sum(spec.bytes_per_token(element) for spec in self.layer_specs)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def blocks_per_request(self, max_model_len: int) -> int:
        """The most blocks one request holds in any group: a sequence of `max_model_len` tokens, or a
        cross-attention group's encoder output."""
        cross = [spec.num_blocks_per_request(self.block_size) for spec in self.layer_specs
                 if isinstance(spec, CrossAttentionSpec)]
        return max([-(-max_model_len // self.block_size), *cross])


def kv_cache_dtype(cache_config: CacheConfig, model_dtype: torch.dtype) -> torch.dtype:
    return torch.float8_e4m3fn if cache_config.kv_cache_dtype == "fp8" else model_dtype


def gpu_kv_cache_budget(total_bytes: int, peak_bytes: int, utilization: float) -> int:
    """Bytes left for the KV cache when the process may use `utilization` of the GPU and the profiling
    forward pass peaked at `peak_bytes` (weights, activations and non-torch memory together)."""
    return int(total_bytes * utilization) - peak_bytes


def num_blocks_for(config: EngineConfig, shape: KVCacheShape, budget: int | None = None,
                   extra_bytes_per_block: int = 0) -> int:
    """Blocks that fit the memory budget (every group gets this many), capped at what max_num_seqs full-length
    sequences could use. `extra_bytes_per_block`: a draft proposer's K/V, which lives in the same blocks.

    Budget precedence: `kv_cache_blocks`, then `kv_cache_memory_bytes`, then the given `budget` (the GPU's
    profiled one), then `cpu_kv_cache_bytes`."""
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    max_len = config.model.max_model_len or 0
    useful = config.scheduler.max_num_seqs * shape.blocks_per_request(max_len)
    if config.cache.kv_cache_memory_bytes is not None:
        budget = config.cache.kv_cache_memory_bytes
    elif budget is None:
        budget = config.cache.cpu_kv_cache_bytes
    bytes_per_block = shape.bytes_per_block + extra_bytes_per_block
    if bytes_per_block < 1:
        raise ConfigError("no attention layer of this model caches anything; kestrel needs a KV cache")
    fitting = budget // bytes_per_block
    if fitting < 1:
        raise ConfigError(f"no room for the KV cache: one block needs {bytes_per_block} bytes and the budget is "
                          f"{max(budget, 0)} bytes; raise gpu_memory_utilization / kv_cache_memory_bytes / "
                          "cpu_kv_cache_bytes or set kv_cache_blocks")
    return int(min(fitting, max(useful, 1)))


def layer_cache_shape(spec: KVCacheSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The cache tensor of one layer: `[2, num_blocks, block_size, num_kv_heads, head_size]` (K then V) for full,
    sliding-window and cross-attention, `[num_blocks, block_size, width]` for a latent cache, empty for none."""
    if isinstance(spec, NoKVCacheSpec):
        return (0,)
    if isinstance(spec, LatentAttentionSpec):
        return (num_blocks, block_size, spec.width)
    return (2, num_blocks, block_size, spec.num_kv_heads, spec.head_size)


def allocate_kv_cache(shape: KVCacheShape, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """One cache tensor per layer, shaped by its spec (`layer_cache_shape`)."""
    return [torch.zeros(layer_cache_shape(spec, num_blocks, shape.block_size), dtype=shape.dtype, device=device)
            for spec in shape.layer_specs]


def kv_cache_groups(specs: Sequence[KVCacheSpec],
                    parallel: ParallelContext | None = None) -> tuple[tuple[KVCacheGroup, ...], list[int | None]]:
    """The model's KV-cache groups, over every pipeline stage's attention layers in layer order (every rank reports
    the same ones to the engine), and the group of each of this stage's layers (`specs`)."""
    every, first = list(specs), 0
    if parallel is not None and parallel.pp_size > 1:
        gathered: list[list[KVCacheSpec] | None] = [None] * parallel.world_size
        dist.all_gather_object(gathered, every, group=parallel.world_group)
        stages = [gathered[stage * parallel.tp_size] or [] for stage in range(parallel.pp_size)]
        first = sum(len(stage) for stage in stages[:parallel.pp_rank])
        every = [spec for stage in stages for spec in stage]
    groups = group_layers(every)
    return groups, layer_group_indices(groups, len(every))[first: first + len(specs)]


def bind_layer_caches(layers: Sequence[CachingLayer], caches: Sequence[torch.Tensor],
                   scales: Sequence[tuple[float, float]] | None, groups: Sequence[int | None]) -> None:
    """Bind each layer's cache, its (k_scale, v_scale) (1.0 when None) and its group."""
    scales = scales if scales is not None else [(1.0, 1.0)] * len(layers)
    for layer, cache, (k_scale, v_scale), group in zip(layers, caches, scales, groups, strict=True):
        if group is None:
            continue  # caches nothing
        layer.bind_kv_cache(cache, k_scale, v_scale, group)


def bind_streaming_window(layers: Sequence[CachingLayer], streaming: StreamingWindowConfig | None) -> None:
    """Attention sinks + window on every attention layer, before the KV cache is sized from their specs."""
    if streaming is None:
        return
    for layer in layers:
        bind = getattr(layer, "bind_streaming", None)
        if bind is None:
            raise ConfigError(f"invalid streaming_window: layer {layer.layer_idx} ({type(layer).__name__}) has no "
                              "sink + window attention; drop streaming_window for this model")
        bind(streaming)


def quest_layer_indices(layers: Sequence[CachingLayer], sparse: SparseDecodeConfig | None) -> list[int]:
    """The attention layers Quest runs on: those of full attention (windowed layers already read a bounded span;
    their blocks keep no bounds) from decoder layer `dense_layers` on. A soft-capped or latent layer is refused by
    name, as is a model without one full-attention layer."""
    if sparse is None:
        return []
    chosen = []
    for i, layer in enumerate(layers):
        spec = layer.cache_spec
        if isinstance(spec, LatentAttentionSpec):
            raise ConfigError(f"invalid sparse_decode: layer {layer.layer_idx} caches latent (MLA) vectors, which "
                              "Quest's per-dimension key bounds do not describe; drop sparse_decode")
        if type(spec) is not FullAttentionSpec or layer.layer_idx < sparse.dense_layers:
            continue
        if getattr(layer, "logit_soft_cap", None) is not None:
            raise ConfigError(f"invalid sparse_decode: layer {layer.layer_idx} soft-caps its attention logits, which "
                              "the sparse decode kernels do not apply; drop sparse_decode for this model")
        chosen.append(i)
    if not chosen and sparse.dense_layers and any(type(layer.cache_spec) is FullAttentionSpec for layer in layers):
        raise ConfigError(f"invalid sparse_decode.dense_layers={sparse.dense_layers}: it keeps every full-attention "
                          "layer dense; lower it below the number of decoder layers")
    if not chosen:
        raise ConfigError("invalid sparse_decode: this model has no full-attention layer (every layer attends "
                          "within a sliding window, which already bounds its reads); drop sparse_decode")
    return chosen


def key_bounds_bytes_per_block(layers: Sequence[CachingLayer], sparse: SparseDecodeConfig | None,
                               block_size: int, cache_dtype: torch.dtype) -> int:
    """Quest's key bounds of one block over the layers it runs on: min and max per page, KV head and head
    dimension (pages x 2 x head_size bounds per KV head, against block_size x 2 x head_size cache elements;
    bfloat16, or an FP8 cache's own dtype)."""
    if sparse is None:
        return 0
    pages = block_size // sparse.page_tokens(block_size)
    specs = [layers[i].cache_spec for i in quest_layer_indices(layers, sparse)]
    size = key_bounds_dtype(cache_dtype).itemsize
    return sum(pages * 2 * spec.num_kv_heads * spec.head_size * size for spec in specs)


def bind_key_bounds(layers: Sequence[CachingLayer], sparse: SparseDecodeConfig | None, num_blocks: int,
                    device: torch.device) -> list[torch.Tensor]:
    """Allocate and bind each Quest layer's key bounds (zeros: a page is only read once written), after the KV
    cache (whose block size gives the pages per block)."""
    bounds = []
    for i in quest_layer_indices(layers, sparse):
        assert sparse is not None
        spec, cache = layers[i].cache_spec, layers[i].kv_cache  # type: ignore[attr-defined]
        block_size = cache.shape[2]
        pages = block_size // sparse.page_tokens(block_size)
        tensor = torch.zeros(num_blocks, pages, 2, spec.num_kv_heads, spec.head_size,
                             dtype=key_bounds_dtype(cache.dtype), device=device)
        layers[i].bind_sparse_decode(tensor, sparse)  # type: ignore[attr-defined]
        bounds.append(tensor)
    return bounds


def kv_scale_key(layer: CachingLayer) -> str:
    """The checkpoint prefix under which a layer's FP8 KV scales are stored."""
    if layer.prefix is None:
        raise ValueError(f"attention layer {layer.layer_idx} has no checkpoint prefix: its FP8 KV scales cannot be "
                         "found; the model must build its Attention modules with prefix=")
    return layer.prefix


def checkpoint_kv_scales(model_dir: str, prefixes: Sequence[str]) -> list[tuple[float, float]] | None:
    """Per-layer (k_scale, v_scale) stored in the checkpoint under each layer's `kv_scale_key` (the names the
    quantization schemes read), or None when it has none. A layer that has only one of the two keeps 1.0 for
    the other."""
    fmt = weight_format(model_dir)
    try:
        files = checkpoint_files(model_dir, fmt or "safetensors")
    except CheckpointNotFoundError:
        return None
    by_name = {name: (position, kind) for position, prefix in enumerate(prefixes)
               for kind, names in KV_SCALE_NAMES.names(prefix).items() for name in names}
    found: dict[int, dict[str, float]] = {}

    def record(name: str, read: Callable[[], torch.Tensor]) -> None:
        hit = by_name.get(name)
        if hit is not None:
            found.setdefault(hit[0], {})[hit[1]] = float(read().float().max())

    if fmt == "pt":
        for name, tensor in iterate_files(files, "pt"):
            record(name, lambda tensor=tensor: tensor)
    for path in files if fmt != "pt" else []:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                record(name, lambda f=f, name=name: f.get_tensor(name))
    if not found:
        return None
    return [(found.get(i, {}).get("k", 1.0), found.get(i, {}).get("v", 1.0)) for i in range(len(prefixes))]


def kv_cache_scales(config: EngineConfig, layers: Sequence[CachingLayer]) -> list[tuple[float, float]]:
    """(k_scale, v_scale) of each of `layers` (a pipeline stage's own): 1.0 for a 16-bit cache; for FP8 the
    checkpoint's, else 1.0 with a warning; 1.0 until the runner measures them with calculate_kv_scales."""
    num_layers = len(layers)
    declared = bool((config.model.hf_config.get("quantization_config") or {}).get("kv_cache_scheme"))
    if config.cache.kv_cache_dtype != "fp8":
        if declared:
            logger.info("the checkpoint carries FP8 KV cache scales (kv_cache_scheme); kv_cache_dtype='fp8' uses them")
        return [(1.0, 1.0)] * num_layers
    if config.cache.calculate_kv_scales:
        logger.info("calculate_kv_scales: the FP8 KV cache scales are measured by a calibration prefill at start-up")
        return [(1.0, 1.0)] * num_layers
    scales = None if config.model.load_format == "dummy" else checkpoint_kv_scales(
        config.model.model, [kv_scale_key(layer) for layer in layers])
    if scales is None and declared:
        raise ConfigError("invalid checkpoint: its quantization_config declares a kv_cache_scheme but no layer has "
                          "k_scale / v_scale tensors; re-export it or drop kv_cache_scheme")
    if scales is None:
        logger.warning("kv_cache_dtype='fp8' but the checkpoint has no KV cache scales: using k_scale = v_scale "
                       "= 1.0, so K/V values beyond +-%g saturate; calculate_kv_scales=True (--calculate-kv-scales) "
                       "measures them at start-up", FP8_E4M3_MAX)
        return [(1.0, 1.0)] * num_layers
    return scales
