"""The shared blocks of decoder-only families: self-attention, the gated MLP and the pre-norm decoder layer,
each built from a `DecoderArch` and each linear layer's quantization method.

The producers of a linear layer's input (a norm, the gated activation) emit what that layer asks for
(`LinearBase.input_quant()`): 8-bit activations in the producer's own launch for W8A8 layers, the model dtype
otherwise. Nothing here knows a quantization method.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kestrel.distributed.parallel import ParallelContext
from kestrel.model.arch import DecoderArch
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.layers.activation import GatedActivation
from kestrel.model.layers.attention import Attention
from kestrel.model.layers.linear import LinearBase, MergedColumnLinear, QKVParallelLinear, RowLinear
from kestrel.model.layers.norm import RMSNorm
from kestrel.model.layers.rotary import RotaryEmbedding
from kestrel.quant.base import QuantMethod

# (layer name, the checkpoint modules it merges) -> that layer's quantization method.
QuantMethodFor = Callable[[str, tuple[str, ...]], QuantMethod]


class SelfAttention(nn.Module):
    """qkv projection, optional per-head q/k RMSNorm, RoPE fused with the KV write, paged attention, o_proj."""

    def __init__(self, arch: DecoderArch, layer_idx: int, dtype: torch.dtype, quant_method: QuantMethodFor,
                 prefix: str, rotary_emb: RotaryEmbedding, parallel: ParallelContext,
                 qkv_parts: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads, bias=arch.qkv_bias,
            quant_method=quant_method(f"{prefix}.qkv_proj", qkv_parts), params_dtype=dtype, parallel=parallel,
        )
        self.o_proj = RowLinear(
            arch.num_heads * arch.head_dim, arch.hidden_size, bias=arch.o_bias,
            quant_method=quant_method(f"{prefix}.o_proj", ()), params_dtype=dtype, parallel=parallel,
        )
        self.head_dim = arch.head_dim
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.norm_eps, dtype)
            self.k_norm = RMSNorm(arch.head_dim, arch.norm_eps, dtype)
        self.qk_norm = arch.qk_norm
        self.rotary_emb = rotary_emb
        # This rank's heads (kv heads replicated when tp_size > num_kv_heads).
        self.attn = Attention(self.qkv_proj.num_heads, arch.head_dim, self.qkv_proj.num_kv_heads,
                              scale=arch.scale, sliding_window=arch.window(layer_idx), layer_idx=layer_idx,
                              logit_soft_cap=arch.logit_soft_cap, prefix=prefix)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden_states))
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return self.o_proj(self.attn(q, k, v, attn_metadata, positions, self.rotary_emb))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one GEMM."""

    def __init__(self, arch: DecoderArch, dtype: torch.dtype, quant_method: QuantMethodFor, prefix: str,
                 parallel: ParallelContext, gate_up_parts: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(
            arch.hidden_size, [arch.intermediate_size] * 2, bias=arch.mlp_bias,
            quant_method=quant_method(f"{prefix}.gate_up_proj", gate_up_parts), params_dtype=dtype,
            parallel=parallel,
        )
        self.down_proj = RowLinear(
            arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias,
            quant_method=quant_method(f"{prefix}.down_proj", ()), params_dtype=dtype, parallel=parallel,
        )
        self.act_fn = GatedActivation(arch.activation)

    def forward(self, x: torch.Tensor, fuse: bool = True) -> torch.Tensor:
        """`x` in the model dtype, or already in the form `gate_up_proj.input_quant()` asks for."""
        return self.down_proj(self.act_fn.feed(self.gate_up_proj(x), self.down_proj, fuse))


class DecoderLayer(nn.Module):
    """Pre-norm: h += attn(norm(h)); h += mlp(norm(h)), the residual add fused into the next norm."""

    def __init__(self, arch: DecoderArch, layer_idx: int, dtype: torch.dtype, quant_method: QuantMethodFor,
                 prefix: str, rotary_emb: RotaryEmbedding, parallel: ParallelContext,
                 packed_modules: dict[str, tuple[str, ...]]) -> None:
        super().__init__()
        attn_prefix, mlp_prefix = f"{prefix}.self_attn", f"{prefix}.mlp"
        self.self_attn = SelfAttention(arch, layer_idx, dtype, quant_method, attn_prefix, rotary_emb, parallel,
                                       _parts(attn_prefix, "qkv_proj", packed_modules))
        self.mlp = GatedMLP(arch, dtype, quant_method, mlp_prefix, parallel,
                            _parts(mlp_prefix, "gate_up_proj", packed_modules))
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.norm_eps, dtype)
        # Producers emit 8-bit input for layers that take it, in their own launch. Can be turned off to compare
        # against the unfused path.
        self.fuse_quant_producers = any(linear.input_quant() is not None for linear in self.producer_consumers())

    def producer_consumers(self) -> tuple[LinearBase, ...]:
        """The linear layers whose input a fused producer makes: qkv and gate_up (norms), down (activation)."""
        return self.self_attn.qkv_proj, self.mlp.gate_up_proj, self.mlp.down_proj

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        fuse = self.fuse_quant_producers
        x, residual = self.input_layernorm.feed(hidden_states, residual, self.self_attn.qkv_proj, fuse)
        hidden_states = self.self_attn(positions, x, attn_metadata)
        x, residual = self.post_attention_layernorm.feed(hidden_states, residual, self.mlp.gate_up_proj, fuse)
        return self.mlp(x, fuse), residual


def _parts(prefix: str, merged: str, packed_modules: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The checkpoint modules a merged layer is made of (q/k/v_proj for qkv_proj), in shard order."""
    return tuple(f"{prefix}.{part}" for part in packed_modules.get(merged, ()))
