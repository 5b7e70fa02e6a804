"""Rotary position embeddings (neox layout: the two halves of each head rotate together), by position.

Scaling types, read from config.json's `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`
(transformers 4), with the formulas of transformers' `modeling_rope_utils`: `default`, `linear`, `llama3`,
`dynamic` (NTK), `yarn` and `longrope` (Phi-3 / Phi-3.5 / Phi-4; `su` is its old name, and so is `yarn` in
Phi-3 configs, as transformers reads them). The legacy `type` key names the type where `rope_type` is absent.
YaRN and LongRoPE also scale cos and sin by an attention factor; it is folded into the cos/sin tables, so every
reader of the tables (`RotaryEmbedding.forward`, `ops.rope_store_kv` and its reference) applies it.

`RotaryEmbedding`'s `max_position` is the context length the engine serves (max_model_len): the length of
the tables, and the length the length-dependent types are fixed for, once. Transformers recomputes them in
each forward from the current sequence length; a KV cache cannot follow that (the keys already cached were
rotated with the old frequencies), so here:
- `dynamic`: the NTK-scaled base of transformers' formula with seq_len = max_position, relative to config.json's
  `max_position_embeddings`; for max_position <= max_position_embeddings that is the default rope, as
  transformers uses for sequences within that length.
- `longrope`: the long factors when max_position > `original_max_position_embeddings`, the short ones
  otherwise (vLLM's rule). Its attention factor does not depend on the served length: as in transformers it is
  `attention_factor`, or else derived from `factor`, or else from max_position_embeddings / original.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kestrel import ops
from kestrel.config import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
_ALIASES = {"su": "longrope"}
_YARN_MEANS_LONGROPE = ("phi3", "phi4_multimodal")  # model types whose old configs called longrope `yarn`
_USES_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")
# Keys that must be present in the scaling dict, by type (`original_max_position_embeddings` may come from the
# top level of config.json or, failing that, from max_position_embeddings).
_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
_NUMBER_KEYS = ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")
_POSITIVE_KEYS = ("factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)  # the scaling entries (factor, ...)
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int | None = None  # config.json's; what dynamic and longrope scale against
    source: str = field(default="rope_parameters", compare=False, repr=False)  # config.json key, for errors

    def __post_init__(self) -> None:
        self._check()

    @classmethod
    def from_hf(cls, hf_config: dict) -> RopeConfig:
        """Read both layouts: `rope_theta` + `rope_scaling` (transformers 4) and `rope_parameters` (5); where
        both are set, `rope_scaling` wins, as in transformers."""
        source = "rope_scaling" if hf_config.get("rope_scaling") else "rope_parameters"
        scaling = hf_config.get(source) or {}
        if not isinstance(scaling, dict) or any(isinstance(v, dict) for v in scaling.values()):
            raise ConfigError(f"invalid config.json {source}={scaling!r}: expected one dict of rope parameters "
                              "(per-layer-type rope parameters are not supported)")
        type_key = "rope_type" if "rope_type" in scaling else "type"
        rope_type = scaling.get(type_key, "default")
        if isinstance(rope_type, str):
            rope_type = _ALIASES.get(rope_type, rope_type)
        if rope_type == "mrope":  # Qwen2-VL's old configs: the default frequencies, rotated by `mrope_section`
            rope_type = "default"
        if rope_type == "yarn" and hf_config.get("model_type") in _YARN_MEANS_LONGROPE:
            rope_type = "longrope"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"invalid config.json {source}.{type_key}={rope_type!r}: supported: "
                              f"{list(SUPPORTED_ROPE_TYPES)} (and the old names {list(_ALIASES)} for 'longrope')")
        theta = scaling.get("rope_theta", hf_config.get("rope_theta", 10000.0))
        factor = scaling.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
        params = {k: v for k, v in scaling.items() if k not in ("rope_type", "type", "rope_theta",
                                                                 "partial_rotary_factor")}
        max_position_embeddings = hf_config.get("max_position_embeddings")
        if rope_type in _USES_ORIGINAL_LENGTH:
            # Phi-3 configs keep the pretraining length at the top level; transformers prefers that one.
            original = next((v for v in (hf_config.get("original_max_position_embeddings"),
                                         params.get("original_max_position_embeddings"), max_position_embeddings)
                             if v is not None), None)
            if original is not None:
                params["original_max_position_embeddings"] = original
        return cls(theta=float(theta), rope_type=rope_type, params=params, partial_rotary_factor=float(factor),
                   max_position_embeddings=None if max_position_embeddings is None else int(max_position_embeddings),
                   source=source)

    def _check(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"invalid config.json {self.source}.rope_type={self.rope_type!r}: supported: "
                              f"{list(SUPPORTED_ROPE_TYPES)}")
        for key in _REQUIRED_KEYS.get(self.rope_type, ()):
            if key not in self.params:
                raise ConfigError(f"invalid config.json {self.source}: rope type {self.rope_type!r} needs "
                                  f"{key!r}, which is missing")
        for key in _NUMBER_KEYS:
            value = self.params.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (key in _POSITIVE_KEYS
                                                                                 and value <= 0):
                kind = "a positive number" if key in _POSITIVE_KEYS else "a number"
                raise ConfigError(f"invalid config.json {self.source}.{key}={value!r}: expected {kind}")
        if self.rope_type in ("linear", "dynamic", "llama3") and self.params["factor"] is None:
            raise ConfigError(f"invalid config.json {self.source}.factor=None: rope type {self.rope_type!r} "
                              "needs a positive number")
        if self.rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                value = self.params[key]
                if not isinstance(value, (list, tuple)) or not all(
                        isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
                    raise ConfigError(f"invalid config.json {self.source}.{key}={value!r}: expected a list of "
                                      "numbers, one per rotated pair of dims")

    def original_length(self) -> int:
        """The pretraining context length of llama3, yarn and longrope."""
        original = self.params.get("original_max_position_embeddings", self.max_position_embeddings)
        if original is None:
            raise ConfigError(f"invalid config.json {self.source}: rope type {self.rope_type!r} needs "
                              "'original_max_position_embeddings' (or max_position_embeddings)")
        return int(original)

    def scale_factor(self) -> float:
        """yarn's and longrope's `factor`; where it is null, max_position_embeddings / original (DeepSeek-V3,
        Phi-3), as in transformers."""
        factor = self.params.get("factor")
        if factor is not None:
            return float(factor)
        if self.max_position_embeddings is None:
            raise ConfigError(f"invalid config.json {self.source}: rope type {self.rope_type!r} needs 'factor' "
                              "(or max_position_embeddings and original_max_position_embeddings)")
        return self.max_position_embeddings / self.original_length()


def compute_inv_freq(rotary_dim: int, rope: RopeConfig, max_position: int) -> torch.Tensor:
    """Inverse frequencies `[rotary_dim // 2]` in float32, after the configured scaling, for serving
    `max_position` positions (see the module docstring for the length-dependent types)."""
    if rope.rope_type == "longrope":
        return _longrope_inv_freq(rotary_dim, rope, max_position)
    theta = _dynamic_ntk_base(rotary_dim, rope, max_position) if rope.rope_type == "dynamic" else rope.theta
    inv_freq = 1.0 / (theta ** _exponents(rotary_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.params["factor"]
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, rope)
    return inv_freq


def compute_attention_factor(rope: RopeConfig) -> float:
    """The factor yarn and longrope scale cos and sin by (1.0 for the other types)."""
    if rope.rope_type not in ("yarn", "longrope"):
        return 1.0
    given = rope.params.get("attention_factor")
    if given is not None:
        return float(given)
    factor = rope.scale_factor()
    if rope.rope_type == "yarn":
        mscale, mscale_all_dim = rope.params.get("mscale"), rope.params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        return _yarn_mscale(factor)
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(rope.original_length()))


def _exponents(rotary_dim: int) -> torch.Tensor:
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a linear blend in between."""
    factor = rope.params["factor"]
    low_freq_factor = rope.params.get("low_freq_factor", 1.0)
    high_freq_factor = rope.params.get("high_freq_factor", 4.0)
    original_context = rope.original_length()
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_between, blended, scaled)


def _dynamic_ntk_base(rotary_dim: int, rope: RopeConfig, max_position: int) -> float:
    """Dynamic NTK: the base grows with the served length past max_position_embeddings."""
    if rope.max_position_embeddings is None:
        raise ConfigError(f"invalid config.json: rope type 'dynamic' ({rope.source}) needs max_position_embeddings")
    if max_position <= rope.max_position_embeddings:
        return rope.theta
    factor = rope.params["factor"]
    stretch = factor * max_position / rope.max_position_embeddings - (factor - 1)
    return rope.theta * stretch ** (rotary_dim / (rotary_dim - 2))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rotary_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: dims that rotate fewer than `beta_slow` times over the original context are interpolated by
    `factor`, those rotating more than `beta_fast` times kept, with a linear ramp over the dims in between."""
    factor = rope.scale_factor()
    original = rope.original_length()
    # transformers reads 0 / null betas as the paper's defaults
    beta_fast = rope.params.get("beta_fast") or 32
    beta_slow = rope.params.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        """The (fractional) dim index whose wavelength fits `rotations` times in the original context."""
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if rope.params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each dim's original frequency
    wavelength_scale = rope.theta ** _exponents(rotary_dim)
    return (1.0 / (factor * wavelength_scale)) * (1 - kept) + (1.0 / wavelength_scale) * kept


def _longrope_inv_freq(rotary_dim: int, rope: RopeConfig, max_position: int) -> torch.Tensor:
    """LongRoPE: each frequency slowed by its own factor, the long ones when serving past the original
    context, the short ones within it."""
    for key in ("short_factor", "long_factor"):
        if len(rope.params[key]) != rotary_dim // 2:
            raise ConfigError(f"invalid config.json {rope.source}.{key}: {len(rope.params[key])} values; the rotary "
                              f"dim is {rotary_dim}, so rope type 'longrope' needs {rotary_dim // 2}")
    key = "long_factor" if max_position > rope.original_length() else "short_factor"
    factors = torch.tensor(rope.params[key], dtype=torch.float32)
    return 1.0 / (factors * rope.theta ** _exponents(rotary_dim))


class RotaryEmbedding(nn.Module):
    """Rotates q `[T, H*D]` and k `[T, H_kv*D]` by `positions [T]` using a cos/sin table precomputed
    up to `max_position`, the context length served (float32, cast to the activations' dtype when applied, as
    HF does). The tables include the attention factor of yarn and longrope."""

    def __init__(self, head_size: int, max_position: int, rope: RopeConfig | None = None) -> None:
        super().__init__()
        rope = rope or RopeConfig()
        self.head_size = head_size
        self.rotary_dim = int(head_size * rope.partial_rotary_factor)
        if self.rotary_dim % 2:
            raise ValueError(f"rotary dim {self.rotary_dim} must be even")
        self.max_position = max_position
        self.rope_type = rope.rope_type
        # A memory plan's model (`plan_memory`, on the meta device) reads the tables' sizes only: its frequencies
        # are computed on the CPU (for the rope config's checks) and its tables left empty. Computed on the meta
        # device, the first `arange` of a process imports sympy and torch's symbolic shapes: seconds of a cold start.
        on_meta = torch.get_default_device().type == "meta"
        with torch.device("cpu") if on_meta else contextlib.nullcontext():
            inv_freq = compute_inv_freq(self.rotary_dim, rope, max_position)
        self.attention_factor = compute_attention_factor(rope)
        if on_meta:
            cos, sin = (torch.empty(max_position, self.rotary_dim // 2, dtype=torch.float32) for _ in range(2))
        else:
            freqs = torch.arange(max_position, dtype=torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
            cos, sin = freqs.cos(), freqs.sin()
            if self.attention_factor != 1.0:
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
        self.register_buffer("cos_cache", cos, persistent=False)  # [max_position, rotary_dim // 2]
        self.register_buffer("sin_cache", sin, persistent=False)
        # M-RoPE (Qwen2-VL): positions `[3, T]` (temporal, height, width); frequency j turns by the row its section
        # of `mrope_section` names (the sections cycle through the three rows).
        section = rope.params.get("mrope_section")
        rows: list[int] | None = None
        if section is not None:
            if not all(isinstance(n, int) and n > 0 for n in section) or sum(section) != self.rotary_dim // 2:
                raise ConfigError(f"invalid config.json {rope.source}.mrope_section={section!r}: expected positive "
                                  f"sizes summing to {self.rotary_dim // 2}, the rotary dim's half")
            rows = [i % 3 for i, n in enumerate(section) for _ in range(n)]
        self.register_buffer("mrope_rows", None if rows is None else torch.tensor(rows, dtype=torch.long),
                             persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions, cos_cache, sin_cache = self._tables(positions)
        cos = cos_cache[positions].unsqueeze(1)  # [T, 1, rotary_dim // 2]
        sin = sin_cache[positions].unsqueeze(1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions `[T]`, cos table, sin table): the cached tables, or for M-RoPE positions `[3, T]` each
        token's own row of the tables (its frequencies at their sections' positions), read at `0..T-1`."""
        if positions.dim() == 1:
            return positions, self.cos_cache, self.sin_cache
        if self.mrope_rows is None:
            raise ValueError(f"positions of shape {tuple(positions.shape)} for a rotary embedding without "
                             "mrope_section")
        index = positions.index_select(0, self.mrope_rows).t()  # [T, rotary_dim // 2]
        own = torch.arange(positions.shape[1], device=positions.device)
        return own, self.cos_cache.gather(0, index), self.sin_cache.gather(0, index)

    def rotate_and_store_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            k_scale: float = 1.0, v_scale: float = 1.0,
                            head_norms: ops.HeadNorms | None = None,
                            staged: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Rotated q `[T, H*D]` (a new tensor); rotated k and v written into the caches
        `[num_blocks, block_size, H_kv, D]` by slot (-1: nowhere), in one `ops.rope_store_kv` launch. Unlike
        `forward`, which rotates in the activations' dtype as HF does, this rotates in fp32 and rounds once.
        `head_norms`: q's and k's per-head RMSNorms, applied before the rotation. `staged`: also filled with the
        rows as written, in token order (`ops.new_staged_kv`)."""
        if k_cache.shape[-1] != self.head_size:
            raise ValueError(f"KV cache head size {k_cache.shape[-1]} != rotary head size {self.head_size}")
        positions, cos_cache, sin_cache = self._tables(positions)
        return ops.rope_store_kv(positions, q, k, v, cos_cache, sin_cache, self.rotary_dim, k_cache,
                                 v_cache, slot_mapping, k_scale, v_scale, head_norms, staged)

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
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
                f"rope_type={self.rope_type}, attention_factor={self.attention_factor:g}")
