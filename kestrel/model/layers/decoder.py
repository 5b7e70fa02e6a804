"""The shared blocks of decoder-only families: self-attention, the gated MLP and the decoder layer (pre-norm,
sandwich, post-norm or parallel), each built from a `DecoderArch` and each linear layer's quantization method.

The producers of a linear layer's input (a norm, the gated activation) emit what that layer asks for
(`LinearBase.input_quant(num_tokens)`, asked with the rows they emit): 8-bit activations in the producer's own
launch for W8A8 layers, the model dtype otherwise (also for an FP8 layer at the decode sizes its GEMV takes).
Nothing here knows a quantization method.

A layer takes and returns `(hidden_states, residual)`, the stream being their sum (residual None before the
first layer), so that each add is fused into the norm that follows it.
"""

from __future__ import annotations

import torch
from torch import nn

from kestrel import ops
from kestrel.distributed.parallel import ParallelContext
from kestrel.model.arch import DecoderArch
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.layers.activation import Activation, GatedActivation
from kestrel.model.layers.attention import Attention
from kestrel.model.layers.linear import ColumnLinear, LinearBase, MergedColumnLinear, QKVParallelLinear, RowLinear
from kestrel.model.layers.moe import MoEMLP, QuantMethodFor
from kestrel.model.layers.norm import LayerNorm, RMSNorm
from kestrel.model.layers.rotary import RotaryEmbedding
from kestrel.model.layers.weights import copy_checked

Norm = RMSNorm | LayerNorm


def make_norm(arch: DecoderArch, size: int, dtype: torch.dtype) -> Norm:
    """The norm the family uses everywhere (`arch.norm`), over `size` features."""
    if arch.norm == "rms":
        return RMSNorm(size, arch.norm_eps, dtype)
    if arch.norm == "rms_unit_offset":
        return RMSNorm(size, arch.norm_eps, dtype, unit_offset=True)
    return LayerNorm(size, arch.norm_eps, dtype, bias=arch.norm == "layer")


class AllHeadsRMSNorm(nn.Module):
    """RMSNorm over all heads of q (or k) at once (OLMo 2), weight `[heads * head_dim]`. Under tensor parallelism
    a rank holds `width` of the features starting at `start`; the mean square is summed over the group. Ranks that
    replicate a kv head each count it once more, which leaves the mean unchanged."""

    def __init__(self, width: int, start: int, eps: float, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        self.eps = eps
        self.start = start
        self.parallel = parallel
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        width = param.shape[0]
        if self.parallel.tp_size > 1:
            loaded = loaded.narrow(0, self.start, width)
        copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return ops.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        square_sum = self.parallel.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        mean_square = square_sum / (x.shape[-1] * self.parallel.tp_size)
        return (xf * torch.rsqrt(mean_square + self.eps)).to(x.dtype) * self.weight


class SelfAttention(nn.Module):
    """qkv projection, optional q/k norm, RoPE fused with the KV write (none on layers without RoPE), paged
    attention, o_proj."""

    def __init__(self, arch: DecoderArch, layer_idx: int, dtype: torch.dtype, quant_method: QuantMethodFor,
                 prefix: str, rotary_emb: RotaryEmbedding | None, parallel: ParallelContext,
                 qkv_parts: tuple[str, ...] = ()) -> None:
        super().__init__()
        rotary_dim = rotary_emb.rotary_dim if rotary_emb is not None else 0
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads, bias=arch.qkv_bias,
            quant_method=quant_method(f"{prefix}.qkv_proj", qkv_parts), params_dtype=dtype, parallel=parallel,
            interleaved_rotary_dim=rotary_dim if arch.rope_interleaved else 0,
        )
        self.o_proj = RowLinear(
            arch.num_heads * arch.head_dim, arch.hidden_size, bias=arch.o_bias,
            quant_method=quant_method(f"{prefix}.o_proj", ()), params_dtype=dtype, parallel=parallel,
        )
        self.head_dim = arch.head_dim
        self.qkv_clip = arch.qkv_clip
        self.qk_norm = arch.qk_norm
        self.per_head_norm = arch.qk_norm_over == "head"
        if arch.qk_norm and self.per_head_norm:
            self.q_norm = make_norm(arch, arch.head_dim, dtype)
            self.k_norm = make_norm(arch, arch.head_dim, dtype)
        elif arch.qk_norm:
            qkv, d = self.qkv_proj, arch.head_dim
            self.q_norm = AllHeadsRMSNorm(qkv.num_heads * d, parallel.tp_rank * qkv.num_heads * d, arch.norm_eps,
                                          dtype, parallel)
            self.k_norm = AllHeadsRMSNorm(qkv.num_kv_heads * d, qkv.kv_head_start * d, arch.norm_eps, dtype,
                                          parallel)
        self.rotary_emb = rotary_emb
        # This rank's heads (kv heads replicated when tp_size > num_kv_heads).
        self.attn = Attention(self.qkv_proj.num_heads, arch.head_dim, self.qkv_proj.num_kv_heads,
                              scale=arch.scale, sliding_window=arch.window(layer_idx), layer_idx=layer_idx,
                              logit_soft_cap=arch.logit_soft_cap, prefix=prefix)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden_states))
        head_norms = None
        if self.qk_norm and self.per_head_norm:
            if self._head_norms_fuse(q):
                head_norms = ops.HeadNorms(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                           self.q_norm.unit_offset)
            else:
                q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
                k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        elif self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qkv_clip is not None:  # after the q/k norms, as OLMoE clips
            q, k, v = (t.clamp(-self.qkv_clip, self.qkv_clip) for t in (q, k, v))
        return self.o_proj(self.attn(q, k, v, attn_metadata, positions, self.rotary_emb, head_norms))

    def _head_norms_fuse(self, q: torch.Tensor) -> bool:
        """Whether the attention applies the per-head q/k RMSNorms itself (with the rotation and KV write)."""
        q_norm, k_norm = self.q_norm, self.k_norm
        return (self.qkv_clip is None and isinstance(q_norm, RMSNorm) and isinstance(k_norm, RMSNorm)
                and q_norm.weight.dtype == q.dtype == k_norm.weight.dtype
                and q_norm.eps == k_norm.eps and q_norm.unit_offset == k_norm.unit_offset)


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

    @property
    def in_proj(self) -> LinearBase:
        return self.gate_up_proj

    @property
    def out_proj(self) -> LinearBase:
        return self.down_proj

    def forward(self, x: torch.Tensor, fuse: bool = True) -> torch.Tensor:
        """`x` in the model dtype, or already in the form `gate_up_proj.input_quant()` asks for. Where the gate/up
        GEMM applies the activation in its epilogue (`apply_gated`; a fusion, so not with `fuse` off), the down
        projection quantizes its input."""
        gated = self.gate_up_proj.apply_gated(x, self.act_fn.activation) if fuse else None
        if gated is not None:
            return self.down_proj(gated)
        return self.down_proj(self.act_fn.feed(self.gate_up_proj(x), self.down_proj, fuse))


class PlainMLP(nn.Module):
    """out(act(in(x))), with the checkpoint's names for in and out (StarCoder2's c_fc and c_proj)."""

    def __init__(self, arch: DecoderArch, dtype: torch.dtype, quant_method: QuantMethodFor, prefix: str,
                 parallel: ParallelContext) -> None:
        super().__init__()
        assert arch.plain_mlp is not None
        self.in_name, self.out_name = arch.plain_mlp
        self.add_module(self.in_name, ColumnLinear(
            arch.hidden_size, arch.intermediate_size, bias=arch.mlp_bias,
            quant_method=quant_method(f"{prefix}.{self.in_name}", ()), params_dtype=dtype, parallel=parallel))
        self.add_module(self.out_name, RowLinear(
            arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias,
            quant_method=quant_method(f"{prefix}.{self.out_name}", ()), params_dtype=dtype, parallel=parallel))
        self.act_fn = Activation(arch.activation)

    @property
    def in_proj(self) -> LinearBase:
        return getattr(self, self.in_name)

    @property
    def out_proj(self) -> LinearBase:
        return getattr(self, self.out_name)

    def forward(self, x: torch.Tensor, fuse: bool = True) -> torch.Tensor:
        return self.out_proj(self.act_fn.feed(self.in_proj(x), self.out_proj, fuse))


class DecoderLayer(nn.Module):
    """Attention then MLP, each with the norms `arch.norms` names around it (pre-norm, sandwich or post-norm),
    or both from one pre-norm (`arch.parallel_block`); the residual add is fused into the next norm."""

    def __init__(self, arch: DecoderArch, layer_idx: int, dtype: torch.dtype, quant_method: QuantMethodFor,
                 prefix: str, rotary_emb: RotaryEmbedding | None, parallel: ParallelContext,
                 packed_modules: dict[str, tuple[str, ...]]) -> None:
        super().__init__()
        attn_prefix = f"{prefix}.self_attn"
        self.self_attn = SelfAttention(arch, layer_idx, dtype, quant_method, attn_prefix, rotary_emb, parallel,
                                       _parts(attn_prefix, "qkv_proj", packed_modules))
        self.mlp_name = arch.moe.module if arch.is_sparse(layer_idx) else "mlp"
        self.mlp_reads_metadata = arch.is_sparse(layer_idx)  # a mixture of experts may count its real tokens
        self.add_module(self.mlp_name, _mlp(arch, layer_idx, dtype, quant_method, f"{prefix}.{self.mlp_name}",
                                            parallel, packed_modules))
        self.norm_names = arch.norms
        for name in (arch.norms.pre_attn, arch.norms.post_attn, arch.norms.pre_mlp, arch.norms.post_mlp):
            if name is not None:
                self.add_module(name, make_norm(arch, arch.hidden_size, dtype))
        self.parallel_block = arch.parallel_block
        self.residual_scale = arch.residual_scale
        # Producers emit 8-bit input for layers that take it, in their own launch. Can be turned off to compare
        # against the unfused path. A parallel block's one norm feeds two layers, which quantize for themselves.
        # Asked with no size: whether a layer ever takes 8-bit input (the producers ask again per step, by size).
        self.fuse_quant_producers = not arch.parallel_block and any(
            linear.input_quant() is not None for linear in self.producer_consumers())

    @property
    def mlp(self) -> nn.Module:
        """The MLP, registered under its checkpoint name (Mixtral's `block_sparse_moe`)."""
        try:
            return self._modules[self.__dict__["mlp_name"]]
        except KeyError:
            raise AttributeError("mlp") from None

    def _norm(self, name: str | None) -> Norm | None:
        return None if name is None else getattr(self, name)

    def producer_consumers(self) -> tuple[LinearBase, ...]:
        """The linear layers whose input a fused producer makes: qkv and the MLP's first (norms), its second
        (activation; a mixture of experts has none outside its kernel)."""
        out_proj = getattr(self.mlp, "out_proj", None)
        return self.self_attn.qkv_proj, self.mlp.in_proj, *([out_proj] if out_proj is not None else [])

    def _sublayer_output(self, out: torch.Tensor, post_norm: Norm | None) -> torch.Tensor:
        if post_norm is not None:
            out = post_norm(out)
        if self.residual_scale != 1.0:
            out = out * self.residual_scale
        return out

    @staticmethod
    def _into(norm: Norm | None, hidden: torch.Tensor, residual: torch.Tensor | None, consumer: LinearBase,
              fuse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(the consumer's input, the new residual): the norm of the stream hidden + residual, or with no norm
        the stream itself."""
        if norm is not None:
            return norm.feed(hidden, residual, consumer, fuse)
        stream = hidden if residual is None else hidden + residual
        return stream, stream

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        fuse = self.fuse_quant_producers
        names = self.norm_names
        x, residual = self._into(self._norm(names.pre_attn), hidden_states, residual, self.self_attn.qkv_proj, fuse)
        attn_out = self._sublayer_output(self.self_attn(positions, x, attn_metadata), self._norm(names.post_attn))
        if self.parallel_block:
            return attn_out + self._sublayer_output(self._mlp_out(x, fuse, attn_metadata), None), residual
        x, residual = self._into(self._norm(names.pre_mlp), attn_out, residual, self.mlp.in_proj, fuse)
        return self._sublayer_output(self._mlp_out(x, fuse, attn_metadata), self._norm(names.post_mlp)), residual

    def _mlp_out(self, x: torch.Tensor, fuse: bool, attn_metadata: AttentionMetadata) -> torch.Tensor:
        if self.mlp_reads_metadata:
            return self.mlp(x, fuse, attn_metadata)
        return self.mlp(x, fuse)


def _mlp(arch: DecoderArch, layer_idx: int, dtype: torch.dtype, quant_method: QuantMethodFor, prefix: str,
         parallel: ParallelContext, packed_modules: dict[str, tuple[str, ...]]) -> nn.Module:
    """The layer's MLP: gated, plain, or the mixture of experts where the family makes this layer sparse."""

    def dense(mlp_arch: DecoderArch, mlp_prefix: str) -> nn.Module:
        if mlp_arch.plain_mlp is not None:
            return PlainMLP(mlp_arch, dtype, quant_method, mlp_prefix, parallel)
        return GatedMLP(mlp_arch, dtype, quant_method, mlp_prefix, parallel,
                        _parts(mlp_prefix, "gate_up_proj", packed_modules))

    if arch.is_sparse(layer_idx):
        return MoEMLP(arch, dtype, quant_method, prefix, parallel, dense)
    return dense(arch, prefix)


def _parts(prefix: str, merged: str, packed_modules: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The checkpoint modules a merged layer is made of (q/k/v_proj for qkv_proj), in shard order."""
    return tuple(f"{prefix}.{part}" for part in packed_modules.get(merged, ()))
