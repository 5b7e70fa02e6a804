"""Mixture-of-experts families: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE. Each is a dense family of its own whose
MLP is, on the layers its config makes sparse, the mixture of experts (`kestrel.model.layers.moe`)."""

from __future__ import annotations

from typing import Any

from kestrel.config import ConfigError
from kestrel.model.arch import DecoderArch, MoEArch
from kestrel.model.base import DecoderForCausalLM
from kestrel.model.llama import qwen_windows


def _field(hf: dict[str, Any], *names: str) -> int:
    """The first of `names` config.json has (transformers writes some under either name)."""
    for name in names:
        if hf.get(name) is not None:
            return int(hf[name])
    raise ConfigError(f"invalid config.json: {names[0]!r} is missing; a "
                      f"{(hf.get('architectures') or ['mixture-of-experts'])[0]} config needs it")


def _qwen_moe(hf: dict[str, Any], shared_expert_size: int = 0) -> MoEArch:
    """Qwen's sparse layers: every `decoder_sparse_step`-th, except those `mlp_only_layers` names."""
    step, dense = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or ())
    num_experts = _field(hf, "num_experts", "num_local_experts")
    sparse = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"]))
    return MoEArch(num_experts=num_experts, top_k=_field(hf, "num_experts_per_tok"),
                   intermediate_size=_field(hf, "moe_intermediate_size"), renormalize=bool(hf.get("norm_topk_prob")),
                   sparse_layers=sparse, shared_expert_size=shared_expert_size)


class MixtralForCausalLM(DecoderForCausalLM):
    """Mistral with `block_sparse_moe` on every layer: experts `w1` (gate), `w3` (up), `w2` (down), weights
    renormalized."""

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        window = hf.get("sliding_window")
        moe = MoEArch(num_experts=_field(hf, "num_local_experts", "num_experts"),
                      top_k=_field(hf, "num_experts_per_tok"), intermediate_size=_field(hf, "intermediate_size"),
                      renormalize=True,
                      sparse_layers=(True,) * hf["num_hidden_layers"], module="block_sparse_moe",
                      expert_parts=("w1", "w3", "w2"))
        return DecoderArch.from_hf(hf, moe=moe,
                                   sliding_windows=(window,) * hf["num_hidden_layers"] if window else ())


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    """Qwen2 (q/k/v bias) with experts and a shared expert behind a sigmoid gate."""

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        moe = _qwen_moe(hf, int(hf.get("shared_expert_intermediate_size") or 0))
        return DecoderArch.from_hf(hf, qkv_bias=True, o_bias=False, moe=moe, sliding_windows=qwen_windows(hf))


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3 (per-head q/k norms) with experts."""

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        return DecoderArch.from_hf(hf, qk_norm=True, moe=_qwen_moe(hf), sliding_windows=qwen_windows(hf))


class OlmoeForCausalLM(DecoderForCausalLM):
    """Pre-norm layers with q/k RMSNorms over all heads, experts on every layer, optional q/k/v clipping."""

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        moe = MoEArch(num_experts=_field(hf, "num_experts", "num_local_experts"),
                      top_k=_field(hf, "num_experts_per_tok"), intermediate_size=_field(hf, "intermediate_size"),
                      renormalize=bool(hf.get("norm_topk_prob")),
                      sparse_layers=(True,) * hf["num_hidden_layers"])
        clip = hf.get("clip_qkv")
        return DecoderArch.from_hf(hf, qk_norm=True, qk_norm_over="all_heads", moe=moe,
                                   qkv_clip=None if clip is None else float(clip))
