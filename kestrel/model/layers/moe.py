"""The mixture-of-experts MLP: a router, every expert's gated MLP stacked into two weights run by one fused kernel
(`ops.fused_moe`), and Qwen2-MoE's shared expert. The experts' parameters, their post-loading and their run belong
to a `FusedMoEMethod` the quantization plan picks (model dtype, or FP8); the router and the shared expert's gate
always run in the model dtype.

Over a tensor-parallel group a rank holds either a slice of every expert's intermediate dimension, or with expert
parallelism whole experts. Either way its output is a partial sum, reduced once over the group. Every rank already
holds every token (attention is tensor-parallel too), so expert parallelism needs no all-to-all: dispatch is each
rank selecting its experts' tokens, and the combine is that one all-reduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from kestrel import ops
from kestrel.config import ConfigError
from kestrel.distributed.parallel import ParallelContext
from kestrel.model.arch import DecoderArch, MoEArch
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.layers.linear import LinearBase, ReplicatedLinear
from kestrel.model.layers.weights import WeightShapeError, copy_checked
from kestrel.quant import FUSED_MOE, UNQUANTIZED
from kestrel.quant.base import FusedMoEMethod, QuantMethod
from kestrel.quant.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod

# (layer name, the checkpoint modules it merges, kind=...) -> that layer's quantization method (the decoder's
# blocks get it as `functools.partial(get_quant_method, plan)`).
QuantMethodFor = Callable[..., QuantMethod | FusedMoEMethod]


class FusedExperts(nn.Module):
    """Every expert's gated MLP, stacked: parameters created by the layer's `FusedMoEMethod` (the unquantized one:
    `w13_weight [E_rank, 2 * I_rank, H]`, each expert's gate rows then its up rows, and `w2_weight
    [E_rank, H, I_rank]`; FP8 adds scales), loaded from the checkpoint's per-expert tensors
    (`{prefix}.{e}.{part}.{suffix}`, each parameter's tags saying which, see `kestrel.quant.base.expert_param`).

    Tensor parallelism gives each rank a slice of every expert (I_rank = I / tp); expert parallelism
    (`parallel.expert_parallel`) gives each rank whole experts, E_rank = E / tp of them, and `local_ids` maps a
    global expert id to this rank's (-1: another rank's, skipped by the kernel)."""

    def __init__(self, moe: MoEArch, hidden_size: int, dtype: torch.dtype, prefix: str,
                 parallel: ParallelContext, quant_method: FusedMoEMethod | None = None) -> None:
        super().__init__()
        tp = parallel.tp_size
        self.prefix = prefix
        self.parallel = parallel
        self.num_experts = moe.num_experts
        self.expert_parallel = parallel.expert_parallel and tp > 1
        full = moe.intermediate_size
        if self.expert_parallel:
            if moe.num_experts % tp:
                raise ConfigError(f"invalid tensor_parallel_size={tp} with enable_expert_parallel: the "
                                  f"{moe.num_experts} experts do not divide evenly over the ranks")
            per_rank = moe.num_experts // tp
            self.first_expert, self.local_experts, self.intermediate = parallel.tp_rank * per_rank, per_rank, full
        else:
            if full % tp:
                raise ConfigError(f"invalid tensor_parallel_size={tp}: the experts' intermediate size {full} is not "
                                  "divisible by it (enable_expert_parallel splits whole experts instead)")
            self.first_expert, self.local_experts, self.intermediate = 0, moe.num_experts, full // tp
        # The group over which each expert's intermediate dimension is split, for methods that need whole rows.
        self.split = tp > 1 and not self.expert_parallel
        self.intermediate_group = parallel if self.split else None
        self.quant_method = quant_method or UnquantizedFusedMoEMethod()
        self.processed = False  # process_after_loading has run (see process_linear_layer)
        self.quant_method.create_weights(self, self.local_experts, hidden_size, self.intermediate, dtype)
        # Every expert's tensors are declared, so that a rank reads past those another rank owns.
        gate, up, down = moe.expert_parts
        for name, param in self.named_parameters(recurse=False):
            parts = (gate, up) if param.expert_proj == "w13" else (down,)
            shape = self._checkpoint_shape(name, param, full)
            param.checkpoint_shards = {f"{prefix}.{e}.{part}.{param.checkpoint_suffix}": ((e, j), shape)
                                       for e in range(moe.num_experts) for j, part in enumerate(parts)}
            param.weight_loader = self.weight_loader
        ids = torch.full((moe.num_experts,), -1, dtype=torch.int32)
        ids[self.first_expert:self.first_expert + self.local_experts] = torch.arange(self.local_experts,
                                                                                     dtype=torch.int32)
        self.register_buffer("local_ids", ids, persistent=False)

    def _checkpoint_shape(self, name: str, param: nn.Parameter, full: int) -> tuple[int, ...]:
        """One expert module's tensor as the checkpoint stores it (whole, before any tensor-parallel slice)."""
        if param.per_tensor:
            return (1,)
        shape = list(param.shape[1:])
        dim, block = param.intermediate_dim, param.intermediate_block
        if dim is not None:
            if self.split and self.intermediate % block:
                raise ConfigError(f"invalid tensor_parallel_size={self.parallel.tp_size} for {self.prefix}: each "
                                  f"rank's share {self.intermediate} of the experts' intermediate size {full} is not a "
                                  f"multiple of the quantization block {block} of {name}; use a tensor_parallel_size "
                                  "that keeps whole blocks, or enable_expert_parallel")
            shape[dim] = -(-full // block)
        return tuple(shape)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        expert, part = shard_id
        local_expert = expert - self.first_expert
        if not 0 <= local_expert < self.local_experts:
            return  # another rank's expert
        target = param.data[local_expert]
        dim = param.intermediate_dim
        num_parts = 2 if param.expert_proj == "w13" else 1
        if dim is not None:  # this part's rows (w13: gate or up) or columns (w2) of the intermediate dimension
            size = target.shape[dim] // num_parts
            target = target.narrow(dim, part * size, size)
        elif num_parts > 1:
            raise ValueError(f"{self.prefix}: a w13 parameter needs an intermediate dim for its gate and up parts")
        detail = f"expert {expert}"
        if param.per_tensor:
            if loaded.numel() != 1:
                raise WeightShapeError(tuple(loaded.shape), (1,), detail)
            target.copy_(loaded.reshape(()).expand(target.shape))
            return
        tp = self.parallel.tp_size
        if self.split and dim is not None and loaded.dim() == target.dim() and loaded.shape[dim] == size * tp:
            loaded = loaded.narrow(dim, self.parallel.tp_rank * size, size)  # this rank's slice of the whole tensor
        if loaded.dim() != target.dim() and loaded.numel() == target.numel():
            loaded = loaded.reshape(target.shape)  # a per-channel scale stored as [N] or [N, 1]
        copy_checked(target, loaded, detail)

    def process_after_loading(self) -> None:
        self.quant_method.process_after_loading(self)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                activation: str) -> torch.Tensor:
        """This rank's partial output of the chosen experts (`topk_ids` global; another rank's experts are
        skipped under expert parallelism)."""
        if self.expert_parallel:
            topk_ids = self.local_ids[topk_ids]
        return self.quant_method.apply(self, x, topk_weights, topk_ids, activation)

    def extra_repr(self) -> str:
        return (f"experts={self.first_expert}:{self.first_expert + self.local_experts} of {self.num_experts}, "
                f"intermediate={self.intermediate}, tp={self.parallel.tp_size}, ep={self.expert_parallel}, "
                f"method={type(self.quant_method).__name__}")


class MoEMLP(nn.Module):
    """`x [T, H]` -> `[T, H]`: the router's top-k over the experts (`MoEArch`: softmax or sigmoid scores, grouped or
    not), the chosen experts' gated MLPs weighted and summed (one fused kernel), plus the shared expert times
    sigmoid(its gate) where there is one."""

    def __init__(self, arch: DecoderArch, dtype: torch.dtype, quant_method: QuantMethodFor, prefix: str,
                 parallel: ParallelContext, dense_mlp: Callable[[DecoderArch, str], nn.Module]) -> None:
        super().__init__()
        moe = arch.moe
        assert moe is not None
        # The experts' method comes from the quantization plan, which sees every expert's checkpoint modules; a
        # scheme without a method for them refuses here, naming the layer.
        experts = f"{prefix}.experts"
        parts = [f"{experts}.{e}.{part}" for e in range(moe.num_experts) for part in moe.expert_parts]
        experts_method = quant_method(experts, parts, kind=FUSED_MOE)
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.scoring, self.num_groups, self.topk_groups = moe.scoring, moe.num_groups, moe.topk_groups
        self.activation = arch.activation
        self.parallel = parallel
        self.router_name = moe.router
        # The router stays in the model dtype (its top-k choice is sensitive to rounding); a checkpoint that
        # quantizes it is refused.
        router = quant_method(f"{prefix}.{moe.router}", (), kind=UNQUANTIZED)
        self.add_module(moe.router, ReplicatedLinear(arch.hidden_size, moe.num_experts, bias=False,
                                                     quant_method=router, params_dtype=dtype))
        self.experts = FusedExperts(moe, arch.hidden_size, dtype, experts, parallel, experts_method)
        self.has_shared_expert = moe.shared_expert_size > 0
        if self.has_shared_expert:
            shared = dataclasses.replace(arch, intermediate_size=moe.shared_expert_size, mlp_bias=False)
            self.shared_expert = dense_mlp(shared, f"{prefix}.shared_expert")
            gate = quant_method(f"{prefix}.shared_expert_gate", (), kind=UNQUANTIZED)
            self.shared_expert_gate = ReplicatedLinear(arch.hidden_size, 1, bias=False, quant_method=gate,
                                                       params_dtype=dtype)
        # int64 [E]: (token, expert) assignments so far, when the engine counts them (`kestrel.model.expert_load`
        # binds a row of its buffer here); None costs nothing.
        self.expert_load: torch.Tensor | None = None

    @property
    def in_proj(self) -> LinearBase:
        """What the norm before the block feeds: the router (model-dtype input; the experts take the same)."""
        return getattr(self, self.router_name)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) of each token's chosen experts. A router that runs these rows
        on the decode GEMV routes in it (`ops.moe_route_gemv`: the same logits and choices)."""
        router = self.in_proj
        # The router's method; grouped top-k runs after the router's own GEMM.
        gemv = (UnquantizedLinearMethod.gemv_config(router, x) if x.dim() == 2 and self.num_groups == 1 else None)
        if gemv is not None:
            return ops.moe_route_gemv(x, router.weight, self.top_k, self.renormalize, config=gemv,
                                      scoring=self.scoring)
        return ops.moe_route(router(x), self.top_k, self.renormalize, self.scoring, self.num_groups,
                             self.topk_groups)

    def forward(self, x: torch.Tensor, fuse: bool = True,
                attn_metadata: AttentionMetadata | None = None) -> torch.Tensor:
        """`attn_metadata`: the step's, which tells real tokens from a CUDA graph's padding (slot -1) when the
        expert load is counted."""
        weights, ids = self.route(x)
        if self.expert_load is not None:
            self._count(ids, attn_metadata)
        out = self.experts(x, weights, ids, self.activation)
        if self.parallel.tp_size > 1:
            out = self.parallel.all_reduce(out)
        if self.has_shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _count(self, ids: torch.Tensor, attn_metadata: AttentionMetadata | None) -> None:
        """Add each real token's chosen experts to `expert_load` on the device (no host sync, capturable). The ids
        are global: every rank routes every token, so each rank's counts are the whole layer's."""
        if attn_metadata is None:
            raise ValueError("counting the expert load needs the step's attention metadata (its padding rows)")
        real = (attn_metadata.slot_mapping >= 0).to(torch.int64)
        self.expert_load.index_add_(0, ids.reshape(-1), real.unsqueeze(1).expand(ids.shape).reshape(-1))
