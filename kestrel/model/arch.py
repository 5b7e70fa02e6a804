"""DecoderArch: what a decoder-only family's config.json says about its shape and its variations.

A family reads its config.json into this one frozen dataclass (`DecoderArch.from_hf` reads the fields most
families name alike; a family passes what it spells differently or fixes by design), and the shared blocks of
`kestrel.model.layers.decoder` are built from it. Adding a variation means a field here with a default that
reproduces every existing family, and the block that honours it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kestrel.config import ConfigError
from kestrel.model.layers.activation import activation_from_hf
from kestrel.model.layers.rotary import RopeConfig


@dataclass(frozen=True)
class DecoderArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    max_position: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer; empty: no window anywhere
    activation: str = "silu"  # of the gated MLP: a name of kestrel.model.layers.activation.ACTIVATIONS
    qk_norm: bool = False  # RMSNorm over each head's query and key, before RoPE
    attention_scale: float | None = None  # None: head_dim ** -0.5
    logit_soft_cap: float | None = None  # attention scores capped as cap * tanh(s / cap)

    def __post_init__(self) -> None:
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ConfigError(f"invalid config.json: {len(self.sliding_windows)} per-layer sliding windows for "
                              f"num_hidden_layers={self.num_layers}")

    def window(self, layer_idx: int) -> int | None:
        return self.sliding_windows[layer_idx] if self.sliding_windows else None

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **family: Any) -> DecoderArch:
        """The common config.json names; `family` overrides or adds fields (e.g. `qkv_bias=True` for Qwen2)."""
        unknown = set(family) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown DecoderArch fields {sorted(unknown)}")
        try:
            num_heads = hf["num_attention_heads"]
            attention_bias = bool(hf.get("attention_bias", False))
            read: dict[str, Any] = {
                "vocab_size": hf["vocab_size"],
                "hidden_size": hf["hidden_size"],
                "intermediate_size": hf["intermediate_size"],
                "num_layers": hf["num_hidden_layers"],
                "num_heads": num_heads,
                "num_kv_heads": hf.get("num_key_value_heads") or num_heads,
                "head_dim": hf.get("head_dim") or hf["hidden_size"] // num_heads,
                "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
                "max_position": int(hf.get("max_position_embeddings", 2048)),
                "rope": RopeConfig.from_hf(hf),
                "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
                "qkv_bias": attention_bias,
                "o_bias": attention_bias,
                "mlp_bias": bool(hf.get("mlp_bias", False)),
                "activation": activation_from_hf(hf.get("hidden_act", "silu")),
            }
        except KeyError as missing:
            raise ConfigError(f"invalid config.json: {missing.args[0]!r} is missing; a "
                              f"{(hf.get('architectures') or ['decoder'])[0]} config needs it") from None
        return cls(**{**read, **family})
