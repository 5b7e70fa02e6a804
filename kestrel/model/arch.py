"""DecoderArch: what a decoder-only family's config.json says about its shape and its variations.

A family reads its config.json into this one frozen dataclass (`DecoderArch.from_hf` reads the fields most
families name alike; a family passes what it spells differently or fixes by design), and the shared blocks of
`kestrel.model.layers.decoder` are built from it. Adding a variation means a field here with a default that
reproduces every existing family, and the block that honours it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from kestrel import ops
from kestrel.config import ConfigError
from kestrel.model.layers.activation import activation_from_hf
from kestrel.model.layers.rotary import RopeConfig

NormKind = Literal["rms", "rms_unit_offset", "layer", "layer_no_bias"]
QKNorm = Literal["head", "all_heads"]


@dataclass(frozen=True)
class LayerNorms:
    """The checkpoint names of a decoder layer's norms by role; None: the layer has no norm there.

    pre-norm (Llama): `pre_attn` and `pre_mlp`; the sandwich (Gemma 2/3, GLM-4) adds `post_attn` and `post_mlp`
    on the sublayers' outputs; post-norm (OLMo 2) has only those two."""

    pre_attn: str | None = "input_layernorm"
    post_attn: str | None = None
    pre_mlp: str | None = "post_attention_layernorm"
    post_mlp: str | None = None

    def __post_init__(self) -> None:
        names = [n for n in (self.pre_attn, self.post_attn, self.pre_mlp, self.post_mlp) if n is not None]
        if len(set(names)) != len(names):
            raise ValueError(f"a norm name is used for two roles: {self}")


SANDWICH_NORMS = LayerNorms("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                            "post_feedforward_layernorm")


@dataclass(frozen=True)
class MoEArch:
    """A mixture-of-experts MLP: a router picks `top_k` of `num_experts` gated MLPs per token by their scores
    (`scoring`: the softmax of its logits, or each logit's sigmoid), their weights renormalized to sum to 1 when
    `renormalize`; with `num_groups` > 1 a token chooses among the experts of its `topk_groups` groups of highest
    best score (DeepSeek's grouped top-k; the families here route ungrouped by softmax). Plus an always-on shared
    expert scaled by a sigmoid gate where `shared_expert_size` is set (Qwen2-MoE). Names are the checkpoint's: the
    block (`block_sparse_moe` in Mixtral), its router, and each expert's gate, up and down projections (`w1`,
    `w3`, `w2` in Mixtral)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool
    sparse_layers: tuple[bool, ...]  # per layer: True where the MLP is this block, False where it stays dense
    shared_expert_size: int = 0
    module: str = "mlp"
    router: str = "gate"
    expert_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ConfigError(f"invalid config.json: num_experts_per_tok={self.top_k} must be in 1..num_experts="
                              f"{self.num_experts}")
        try:
            ops.check_moe_routing(self.num_experts, self.top_k, self.scoring, self.num_groups, self.topk_groups)
        except ValueError as e:
            raise ConfigError(f"invalid config.json: the router's {e}") from None
        if self.intermediate_size <= 0:
            raise ConfigError(f"invalid config.json: the experts' intermediate size {self.intermediate_size} must "
                              "be > 0")


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
    max_position: int  # config.json's max_position_embeddings
    rope: RopeConfig
    context_len: int | None = None  # the context the engine serves (None: max_position)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer; empty: no window anywhere
    activation: str = "silu"  # of the MLP: a name of kestrel.model.layers.activation.ACTIVATIONS
    plain_mlp: tuple[str, str] | None = None  # a non-gated MLP's (in, out) checkpoint names; None: gated MLP
    qk_norm: bool = False  # RMSNorm over each head's query and key (or over all heads: qk_norm_over), before RoPE
    qk_norm_over: QKNorm = "head"
    attention_scale: float | None = None  # None: head_dim ** -0.5
    logit_soft_cap: float | None = None  # attention scores capped as cap * tanh(s / cap)
    norm: NormKind = "rms"  # every norm of the model: the layers', q/k's and the final one
    norms: LayerNorms = LayerNorms()
    parallel_block: bool = False  # h + attn(norm(h)) + mlp(norm(h)) from one pre-norm (Command R)
    embedding_scale: float | None = None  # embeddings times this, rounded to the model dtype (Gemma, Granite)
    residual_scale: float = 1.0  # each sublayer's output times this before the residual add (Granite)
    final_logit_soft_cap: float | None = None  # logits capped as cap * tanh(l / cap) (Gemma 2)
    logit_scale: float = 1.0  # logits times this (Command R's logit_scale, 1 / Granite's logits_scaling)
    rope_local: RopeConfig | None = None  # the rotary embedding of sliding-window layers, when it differs
    rope_interleaved: bool = False  # RoPE rotates pairs (2i, 2i+1) instead of the two halves (GLM, Command R)
    rope_layers: tuple[bool, ...] = ()  # per layer: False where a layer has no RoPE; empty: every layer has it
    moe: MoEArch | None = None  # the mixture-of-experts MLP of the layers it names
    qkv_clip: float | None = None  # q, k and v clamped to +-this after their projection (OLMoE's clip_qkv)

    def __post_init__(self) -> None:
        for name in ("sliding_windows", "rope_layers"):
            per_layer = getattr(self, name)
            if per_layer and len(per_layer) != self.num_layers:
                raise ConfigError(f"invalid config.json: {len(per_layer)} per-layer entries ({name}) for "
                                  f"num_hidden_layers={self.num_layers}")
        if self.parallel_block and (self.norms.post_attn or self.norms.post_mlp or self.norms.pre_mlp):
            raise ValueError("a parallel block has one pre-norm only")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ConfigError(f"invalid config.json: {len(self.moe.sparse_layers)} per-layer MoE entries for "
                              f"num_hidden_layers={self.num_layers}")

    def is_sparse(self, layer_idx: int) -> bool:
        """True where the layer's MLP is the mixture of experts."""
        return self.moe is not None and self.moe.sparse_layers[layer_idx]

    def window(self, layer_idx: int) -> int | None:
        return self.sliding_windows[layer_idx] if self.sliding_windows else None

    def has_rope(self, layer_idx: int) -> bool:
        return self.rope_layers[layer_idx] if self.rope_layers else True

    @property
    def rotary_length(self) -> int:
        """The rotary tables' length: the context served (length-dependent RoPE scaling is computed for it)."""
        return self.context_len or self.max_position

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
                "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
                "qkv_bias": attention_bias,
                "o_bias": attention_bias,
                "mlp_bias": bool(hf.get("mlp_bias", False)),
                "activation": activation_from_hf(hf.get("hidden_act", "silu")),
            }
            if "rope" not in family:
                read["rope"] = RopeConfig.from_hf(hf)
        except KeyError as missing:
            raise ConfigError(f"invalid config.json: {missing.args[0]!r} is missing; a "
                              f"{(hf.get('architectures') or ['decoder'])[0]} config needs it") from None
        return cls(**{**read, **family})


def layer_types(hf: dict[str, Any], global_every: int | None = None) -> list[str]:
    """config.json `layer_types` ("full_attention" / "sliding_attention" per layer), checked. A config without it
    has full attention everywhere, or with `global_every` (or the config's `sliding_window_pattern`) every that
    many-th layer global and the others sliding."""
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        if global_every is None:
            return ["full_attention"] * num_layers
        every = int(hf.get("sliding_window_pattern") or global_every)
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ConfigError(f"unsupported layer_types={types!r} in config.json: kestrel takes one of "
                          f"'full_attention' or 'sliding_attention' per layer ({num_layers} layers)")
    return list(types)


def windows_of(hf: dict[str, Any], types: list[str]) -> tuple[int | None, ...]:
    """Per-layer windows: config.json `sliding_window` on the sliding layers, None elsewhere."""
    window = hf.get("sliding_window")
    if window is None and "sliding_attention" in types:
        raise ConfigError("invalid config.json: layer_types has sliding_attention layers but sliding_window is null")
    return tuple(window if t == "sliding_attention" else None for t in types)
