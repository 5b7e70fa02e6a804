"""The Llama family: Llama 2/3, Mistral and Qwen2 share one decoder; they differ only in config reading."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from kestrel import ops
from kestrel.config import ConfigError, QuantConfig
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.layers.activation import SiluAndMul
from kestrel.model.layers.attention import Attention
from kestrel.model.layers.embedding import LMHead, VocabEmbedding
from kestrel.model.layers.linear import (
    LinearBase,
    MergedColumnLinear,
    QKVParallelLinear,
    RowLinear,
    process_linear_layers_after_loading,
)
from kestrel.model.layers.norm import RMSNorm
from kestrel.model.layers.rotary import RopeConfig, RotaryEmbedding
from kestrel.model.layers.weights import WeightShapeError
from kestrel.quant import QuantPlan, get_quant_method
from kestrel.quant.w8a8 import QuantAct, W8A8LinearMethod

# The quantization a model is built with: the plan, or an online QuantConfig (tests), or none.
Quantization = QuantPlan | QuantConfig | None

# checkpoint sub-name -> (our merged module, shard id)
_STACKED = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached",
                     # FP8 KV cache scales: read by the worker when it sizes the cache, not parameters here.
                     "self_attn.k_scale", "self_attn.v_scale", "attn.k_scale", "attn.v_scale",
                     "k_proj.output_scale", "v_proj.output_scale")


class WeightLoadingError(ValueError):
    """The checkpoint does not fit the model: missing, unexpected or mis-shaped tensors."""


@dataclass(frozen=True)
class LlamaArchConfig:
    """The fields of a Hugging Face config.json that the decoder needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]  # per layer

    @classmethod
    def from_hf(cls, hf: dict, *, qkv_bias: bool | None = None, o_bias: bool | None = None,
                sliding_windows: tuple[int | None, ...] | None = None) -> LlamaArchConfig:
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"unsupported hidden_act={act!r} in config.json; this model family supports 'silu'")
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position=int(hf.get("max_position_embeddings", 2048)),
            rope=RopeConfig.from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if o_bias is None else o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_windows=sliding_windows or (None,) * num_layers,
        )


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, layer_idx: int, dtype: torch.dtype, quant_config: Quantization,
                 prefix: str, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, bias=cfg.qkv_bias,
            quant_method=get_quant_method(quant_config, f"{prefix}.qkv_proj", _parts(f"{prefix}.qkv_proj")),
            params_dtype=dtype,
        )
        self.o_proj = RowLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias,
            quant_method=get_quant_method(quant_config, f"{prefix}.o_proj"), params_dtype=dtype,
        )
        self.rotary_emb = rotary_emb
        self.attn = Attention(cfg.num_heads, cfg.head_dim, cfg.num_kv_heads, scale=cfg.head_dim**-0.5,
                              sliding_window=cfg.sliding_windows[layer_idx], layer_idx=layer_idx)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden_states), attn_metadata)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Everything after the qkv projection: RoPE fused with the KV write, attention, o_proj."""
        q, k, v = self.qkv_proj.split_qkv(qkv)
        return self.o_proj(self.attn(q, k, v, attn_metadata, positions, self.rotary_emb))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, quant_config: Quantization,
                 prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias,
            quant_method=get_quant_method(quant_config, f"{prefix}.gate_up_proj", _parts(f"{prefix}.gate_up_proj")),
            params_dtype=dtype,
        )
        self.down_proj = RowLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias,
            quant_method=get_quant_method(quant_config, f"{prefix}.down_proj"), params_dtype=dtype,
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, layer_idx: int, dtype: torch.dtype, quant_config: Quantization,
                 prefix: str, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, dtype, quant_config, f"{prefix}.self_attn", rotary_emb)
        self.mlp = LlamaMLP(cfg, dtype, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # W8A8 linears take activations quantized by the op before them (norm, SiLU-mul): one launch instead
        # of two. Can be turned off to compare against the unfused path.
        self.fuse_quant_producers = all(
            isinstance(linear.quant_method, W8A8LinearMethod)
            for linear in (self.self_attn.qkv_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fuse_quant_producers:
            return self._forward_fused(positions, hidden_states, residual, attn_metadata)
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def _forward_fused(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                       attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        attn, mlp = self.self_attn, self.mlp
        if residual is None:
            act, _ = _norm_quant(self.input_layernorm, hidden_states, None, attn.qkv_proj)
            residual = hidden_states
        else:
            act, residual = _norm_quant(self.input_layernorm, hidden_states, residual, attn.qkv_proj)
        qkv = _apply_quantized(attn.qkv_proj, act, hidden_states.dtype)
        hidden_states = attn.attend(positions, qkv, attn_metadata)
        act, residual = _norm_quant(self.post_attention_layernorm, hidden_states, residual, mlp.gate_up_proj)
        gate_up = _apply_quantized(mlp.gate_up_proj, act, hidden_states.dtype)
        spec = mlp.down_proj.quant_method.input_quant(mlp.down_proj)
        act = ops.silu_mul_quant(gate_up, spec.dtype, spec.scale, spec.azp, spec.symmetric)
        return _apply_quantized(mlp.down_proj, act, hidden_states.dtype), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, quant_config: Quantization) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        # One cos/sin table for all layers: at 128k positions it is 64 MB, which per layer would be 2 GB for 32.
        rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, dtype, quant_config, f"model.layers.{i}", rotary_emb)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T], attn_metadata) -> hidden [T, hidden]`;
    `compute_logits(hidden [R, hidden]) -> float32 logits [R, vocab]`."""

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32,
                 quant_config: Quantization = None) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.dtype = dtype
        self.config = self.arch_config(hf_config)
        self.model = LlamaModel(self.config, dtype, quant_config)
        if isinstance(quant_config, QuantPlan):
            quant_config.check_unquantized("lm_head")
        tie = self.model.embed_tokens if self.config.tie_word_embeddings else None
        self.lm_head = LMHead(self.config.vocab_size, self.config.hidden_size, dtype, tie_to=tie)

    @classmethod
    def arch_config(cls, hf: dict) -> LlamaArchConfig:
        return LlamaArchConfig.from_hf(hf)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def attention_layers(self) -> list[Attention]:
        """The Attention modules in layer order, for the runner to bind one KV cache each."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def bind_kv_caches(self, kv_caches: list[torch.Tensor], k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        layers = self.attention_layers()
        if len(kv_caches) != len(layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(layers)} attention layers")
        for layer, cache in zip(layers, kv_caches):
            layer.bind_kv_cache(cache, k_scale, v_scale)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_size) of the per-layer KV caches."""
        return self.config.num_layers, self.config.num_kv_heads, self.config.head_dim

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) in through each parameter's weight_loader, check that
        every parameter was loaded, then let the quant methods post-process."""
        params = dict(self.named_parameters())
        expected = {hf_name for name, param in params.items() for hf_name in _checkpoint_names(name, param)}
        seen: set[str] = set()
        with torch.no_grad():
            for hf_name, tensor in weights:
                if hf_name.endswith(_SKIPPED_SUFFIXES):
                    continue
                if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                name, shard_id = _to_param_name(hf_name)
                param = params.get(name)
                if param is None:
                    raise WeightLoadingError(
                        f"checkpoint tensor {hf_name!r} has no matching parameter in {type(self).__name__}"
                    )
                try:
                    param.weight_loader(param, tensor, shard_id)
                except WeightShapeError as e:
                    raise WeightLoadingError(
                        f"tensor {hf_name!r}: checkpoint shape {e.loaded_shape} does not match the model's "
                        f"{e.expected_shape}"
                    ) from e
                seen.add(hf_name)
        missing = sorted(expected - seen)
        if missing:
            shown = ", ".join(missing[:20]) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
            raise WeightLoadingError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        process_linear_layers_after_loading(self)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with an optional sliding window on every layer."""

    @classmethod
    def arch_config(cls, hf: dict) -> LlamaArchConfig:
        window = hf.get("sliding_window")
        return LlamaArchConfig.from_hf(hf, sliding_windows=(window,) * hf["num_hidden_layers"])


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v bias (no o_proj bias); sliding window only where `use_sliding_window` asks."""

    @classmethod
    def arch_config(cls, hf: dict) -> LlamaArchConfig:
        num_layers = hf["num_hidden_layers"]
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first_windowed = hf.get("max_window_layers", num_layers)
            layer_types = ["sliding_attention" if window is not None and i >= first_windowed else "full_attention"
                           for i in range(num_layers)]
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        return LlamaArchConfig.from_hf(hf, qkv_bias=True, o_bias=False, sliding_windows=windows)


def _norm_quant(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
                consumer: LinearBase) -> tuple[QuantAct, torch.Tensor | None]:
    """RMSNorm (+ residual add) emitting `consumer`'s quantized input; the new residual when one was given."""
    spec = consumer.quant_method.input_quant(consumer)
    return ops.rms_norm_quant(x, norm.weight, norm.eps, spec.dtype, residual, spec.scale, spec.azp, spec.symmetric)


def _apply_quantized(linear: LinearBase, act: QuantAct, out_dtype: torch.dtype) -> torch.Tensor:
    # A row layer adds its bias on rank 0 only (see RowLinear.forward); tensor parallelism is not wired here.
    bias = linear.bias if linear.tp_rank == 0 else None
    return linear.quant_method.apply_quantized(linear, act, out_dtype, bias)


def _parts(merged_name: str) -> tuple[str, ...]:
    """The checkpoint modules a merged layer is made of (q/k/v_proj for qkv_proj), in shard order."""
    merged = merged_name.rsplit(".", 1)[-1]
    prefix = merged_name[: -len(merged)]
    return tuple(prefix + part for part, target, _ in _STACKED if target == merged)


def _to_param_name(hf_name: str) -> tuple[str, str | int | None]:
    for part, merged, shard_id in _STACKED:
        if f".{part}." in hf_name:
            return hf_name.replace(f".{part}.", f".{merged}."), shard_id
    return hf_name, None


def _checkpoint_names(param_name: str, param: nn.Parameter) -> list[str]:
    """The HF tensor names that together fill `param` (three for a qkv weight, two for gate_up)."""
    if getattr(param, "checkpoint_optional", False):
        return []
    names = [param_name.replace(f".{merged}.", f".{part}.") for part, merged, _ in _STACKED
             if f".{merged}." in param_name]
    return names or [param_name]
