"""Rotary position embeddings (neox layout: the two halves of each head rotate together), by position."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kestrel import ops
from kestrel.config import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)  # the scaling entries (factor, ...)
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(cls, hf_config: dict) -> RopeConfig:
        """Read both layouts: `rope_theta` + `rope_scaling` (transformers 4) and `rope_parameters` (5)."""
        scaling = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"unsupported rope type {rope_type!r} in config.json; "
                              f"supported: {list(SUPPORTED_ROPE_TYPES)}")
        theta = scaling.get("rope_theta", hf_config.get("rope_theta", 10000.0))
        factor = scaling.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
        params = {k: v for k, v in scaling.items() if k not in ("rope_type", "type", "rope_theta",
                                                                 "partial_rotary_factor")}
        return cls(theta=float(theta), rope_type=rope_type, params=params, partial_rotary_factor=float(factor))


def compute_inv_freq(rotary_dim: int, rope: RopeConfig, max_position: int) -> torch.Tensor:
    """Inverse frequencies `[rotary_dim // 2]` in float32, after the configured scaling."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.params["factor"]
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope.params, max_position)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, Any], max_position: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a linear blend in between."""
    factor = params["factor"]
    low_freq_factor = params.get("low_freq_factor", 1.0)
    high_freq_factor = params.get("high_freq_factor", 4.0)
    original_context = params.get("original_max_position_embeddings", max_position)
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_between, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates q `[T, H*D]` and k `[T, H_kv*D]` by `positions [T]` using a cos/sin table precomputed
    up to `max_position` (float32, cast to the activations' dtype when applied, as HF does)."""

    def __init__(self, head_size: int, max_position: int, rope: RopeConfig | None = None) -> None:
        super().__init__()
        rope = rope or RopeConfig()
        self.head_size = head_size
        self.rotary_dim = int(head_size * rope.partial_rotary_factor)
        if self.rotary_dim % 2:
            raise ValueError(f"rotary dim {self.rotary_dim} must be even")
        self.max_position = max_position
        inv_freq = compute_inv_freq(self.rotary_dim, rope, max_position)
        freqs = torch.arange(max_position, dtype=torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)  # [max_position, rotary_dim // 2]
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, rotary_dim // 2]
        sin = self.sin_cache[positions].unsqueeze(1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def rotate_and_store_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """Rotated q `[T, H*D]` (a new tensor); rotated k and v written into the caches
        `[num_blocks, block_size, H_kv, D]` by slot (-1: nowhere), in one `ops.rope_store_kv` launch. Unlike
        `forward`, which rotates in the activations' dtype as HF does, this rotates in fp32 and rounds once."""
        if k_cache.shape[-1] != self.head_size:
            raise ValueError(f"KV cache head size {k_cache.shape[-1]} != rotary head size {self.head_size}")
        return ops.rope_store_kv(positions, q, k, v, self.cos_cache, self.sin_cache, self.rotary_dim, k_cache,
                                 v_cache, slot_mapping, k_scale, v_scale)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if rest.shape[-1]:
            rotated = torch.cat((rotated, rest), dim=-1)
        return rotated.reshape(shape)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}"
