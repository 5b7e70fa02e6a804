"""The Llama family: Llama 2/3, Mistral and Qwen2 share one decoder; they differ only in config reading."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from kestrel import ops
from kestrel.config import ConfigError, QuantConfig
from kestrel.distributed.parallel import ParallelContext, single_process
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
                 prefix: str, rotary_emb: RotaryEmbedding, parallel: ParallelContext) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, bias=cfg.qkv_bias,
            quant_method=get_quant_method(quant_config, f"{prefix}.qkv_proj", _parts(f"{prefix}.qkv_proj")),
            params_dtype=dtype, parallel=parallel,
        )
        self.o_proj = RowLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias,
            quant_method=get_quant_method(quant_config, f"{prefix}.o_proj"), params_dtype=dtype, parallel=parallel,
        )
        self.rotary_emb = rotary_emb
        # This rank's heads (kv heads replicated when tp_size > num_kv_heads).
        self.attn = Attention(self.qkv_proj.num_heads, cfg.head_dim, self.qkv_proj.num_kv_heads,
                              scale=cfg.head_dim**-0.5, sliding_window=cfg.sliding_windows[layer_idx],
                              layer_idx=layer_idx)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden_states), attn_metadata)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Everything after the qkv projection: RoPE fused with the KV write, attention, o_proj."""
        q, k, v = self.qkv_proj.split_qkv(qkv)
        return self.o_proj(self.attn(q, k, v, attn_metadata, positions, self.rotary_emb))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, quant_config: Quantization,
                 prefix: str, parallel: ParallelContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias,
            quant_method=get_quant_method(quant_config, f"{prefix}.gate_up_proj", _parts(f"{prefix}.gate_up_proj")),
            params_dtype=dtype, parallel=parallel,
        )
        self.down_proj = RowLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias,
            quant_method=get_quant_method(quant_config, f"{prefix}.down_proj"), params_dtype=dtype, parallel=parallel,
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, layer_idx: int, dtype: torch.dtype, quant_config: Quantization,
                 prefix: str, rotary_emb: RotaryEmbedding, parallel: ParallelContext) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, dtype, quant_config, f"{prefix}.self_attn", rotary_emb,
                                        parallel)
        self.mlp = LlamaMLP(cfg, dtype, quant_config, f"{prefix}.mlp", parallel)
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
        if mlp.down_proj.needs_global_input_scale:
            # Per-token scales over the whole intermediate row, which no rank holds: SiLU-mul, then the row
            # layer's group-wide quantization.
            act = mlp.down_proj.quantize_input(mlp.act_fn(gate_up))
        else:
            spec = mlp.down_proj.quant_method.input_quant(mlp.down_proj)
            act = ops.silu_mul_quant(gate_up, spec.dtype, spec.scale, spec.azp, spec.symmetric)
        return _apply_quantized(mlp.down_proj, act, hidden_states.dtype), residual


class LlamaModel(nn.Module):
    """Under pipeline parallelism a stage builds only its own layers (the others are empty placeholders, so
    parameter names keep their layer index), the first stage the embedding, the last the final norm."""

    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, quant_config: Quantization,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.hidden_size = cfg.hidden_size
        self.dtype = dtype
        self.stage_layers = parallel.stage_layers(cfg.num_layers)
        if parallel.is_first_stage:
            self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, parallel)
        # One cos/sin table for all layers: at 128k positions it is 64 MB, which per layer would be 2 GB for 32.
        rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, dtype, quant_config, f"model.layers.{i}", rotary_emb, parallel)
            if i in self.stage_layers else nn.Identity()
            for i in range(cfg.num_layers)
        )
        if parallel.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        parallel = self.parallel
        if parallel.is_first_stage:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            like = ((input_ids.shape[0], self.hidden_size), self.dtype)
            hidden_states, residual = parallel.recv_from_prev_stage([like, like], input_ids.device)
        for i in self.stage_layers:
            hidden_states, residual = self.layers[i](positions, hidden_states, residual, attn_metadata)
        if not parallel.is_last_stage:
            parallel.send_to_next_stage([hidden_states, residual])
            # Only the last stage computes logits; an earlier stage's output is never read.
            return hidden_states
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T], attn_metadata) -> hidden [T, hidden]`;
    `compute_logits(hidden [R, hidden]) -> float32 logits [R, vocab]`."""

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32,
                 quant_config: Quantization = None, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.dtype = dtype
        self.parallel = parallel or single_process()
        self.config = self.arch_config(hf_config)
        self.model = LlamaModel(self.config, dtype, quant_config, self.parallel)
        if isinstance(quant_config, QuantPlan):
            quant_config.check_unquantized("lm_head")
        if self.parallel.is_last_stage:
            # A last stage that is not the first has no embedding to tie to: it loads the embedding's tensor.
            tie = self.model.embed_tokens if self.config.tie_word_embeddings and self.parallel.is_first_stage else None
            self.lm_head = LMHead(self.config.vocab_size, self.config.hidden_size, dtype, tie_to=tie,
                                  parallel=self.parallel)

    @classmethod
    def arch_config(cls, hf: dict) -> LlamaArchConfig:
        return LlamaArchConfig.from_hf(hf)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 logits. Under pipeline parallelism only the last stage has an LM head: it alone samples, and
        the other stages learn the sampled ids from the engine (kestrel.distributed.worker)."""
        return self.lm_head(hidden_states)

    def attention_layers(self) -> list[Attention]:
        """This stage's Attention modules in layer order, for the runner to bind one KV cache each."""
        return [self.model.layers[i].self_attn.attn for i in self.model.stage_layers]

    def bind_kv_caches(self, kv_caches: list[torch.Tensor], k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        layers = self.attention_layers()
        if len(kv_caches) != len(layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(layers)} attention layers")
        for layer, cache in zip(layers, kv_caches):
            layer.bind_kv_cache(cache, k_scale, v_scale)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_size) of this rank's per-layer KV caches (its stage's layers, its
        share of the kv heads)."""
        layers = self.attention_layers()
        num_kv_heads = layers[0].num_kv_heads if layers else self.config.num_kv_heads
        return len(layers), num_kv_heads, self.config.head_dim

    def owns_checkpoint_tensor(self, hf_name: str) -> bool:
        """False for a tensor that belongs to another pipeline stage."""
        if self.parallel.pp_size == 1:
            return True
        if hf_name.startswith("model.layers."):
            return int(hf_name.split(".")[2]) in self.model.stage_layers
        if hf_name.startswith("model.embed_tokens."):
            tied_here = self.config.tie_word_embeddings and self.parallel.is_last_stage
            return self.parallel.is_first_stage or tied_here
        if hf_name.startswith(("model.norm.", "lm_head.")):
            return self.parallel.is_last_stage
        return True

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
                if not self.owns_checkpoint_tensor(hf_name):
                    continue
                name, shard_id = _to_param_name(hf_name)
                if name == "model.embed_tokens.weight" and not self.parallel.is_first_stage:
                    name = hf_name = "lm_head.weight"  # the tied head of a last stage without the embedding
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
    # The layer adds its bias (a row layer on tp rank 0 only) and, for a row layer, sums over the group.
    return linear.apply_quantized(act, out_dtype)


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
