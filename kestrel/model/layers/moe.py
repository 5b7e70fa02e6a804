"""The mixture-of-experts MLP: a router, every expert's gated MLP stacked into two weights run by one fused kernel
(`ops.fused_moe`), and Qwen2-MoE's shared expert.

Over a tensor-parallel group a rank holds either a slice of every expert's intermediate dimension, or with expert
parallelism whole experts. Either way its output is a partial sum, reduced once over the group. Every rank already
holds every token (attention is tensor-parallel too), so expert parallelism needs no all-to-all: dispatch is each
rank selecting its experts' tokens, and the combine is that one all-reduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kestrel import ops
from kestrel.config import ConfigError
from kestrel.distributed.parallel import ParallelContext
from kestrel.model.arch import DecoderArch, MoEArch
from kestrel.model.layers.linear import LinearBase, ReplicatedLinear
from kestrel.model.layers.weights import copy_checked
from kestrel.quant import FUSED_MOE
from kestrel.quant.base import QuantMethod
from kestrel.quant.unquantized import UnquantizedLinearMethod

QuantMethodFor = Callable[..., QuantMethod]


class FusedExperts(nn.Module):
    """`w13_weight [E_rank, 2 * I_rank, H]` (each expert's gate rows, then its up rows) and
    `w2_weight [E_rank, H, I_rank]`, loaded from the checkpoint's per-expert tensors (`{prefix}.{e}.{part}.weight`).

    Tensor parallelism gives each rank a slice of every expert (I_rank = I / tp); expert parallelism
    (`parallel.expert_parallel`) gives each rank whole experts, E_rank = E / tp of them, and `local_ids` maps a
    global expert id to this rank's (-1: another rank's, skipped by the kernel)."""

    def __init__(self, moe: MoEArch, hidden_size: int, dtype: torch.dtype, prefix: str,
                 parallel: ParallelContext) -> None:
        super().__init__()
        tp = parallel.tp_size
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
        local = self.intermediate
        self.w13_weight = nn.Parameter(torch.empty(self.local_experts, 2 * local, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.local_experts, hidden_size, local, dtype=dtype),
                                      requires_grad=False)
        # Every expert's tensors are declared, so that a rank reads past those another rank owns.
        gate, up, down = moe.expert_parts
        self.w13_weight.checkpoint_shards = {
            f"{prefix}.{e}.{part}.weight": ((e, j), (full, hidden_size))
            for e in range(moe.num_experts) for j, part in enumerate((gate, up))}
        self.w2_weight.checkpoint_shards = {f"{prefix}.{e}.{down}.weight": ((e, 0), (hidden_size, full))
                                            for e in range(moe.num_experts)}
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader
        ids = torch.full((moe.num_experts,), -1, dtype=torch.int32)
        ids[self.first_expert:self.first_expert + self.local_experts] = torch.arange(self.local_experts,
                                                                                     dtype=torch.int32)
        self.register_buffer("local_ids", ids, persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        expert, part = shard_id
        local_expert = expert - self.first_expert
        if not 0 <= local_expert < self.local_experts:
            return  # another rank's expert
        local = self.intermediate
        rank = 0 if self.expert_parallel else self.parallel.tp_rank
        if param is self.w13_weight:  # this rank's rows of the gate (part 0) or up (part 1) projection
            target = param.data[local_expert, part * local:(part + 1) * local]
            if loaded.dim() == 2 and loaded.shape[0] != local:
                loaded = loaded[rank * local:(rank + 1) * local]
        else:  # this rank's columns of the down projection
            target = param.data[local_expert]
            if loaded.dim() == 2 and loaded.shape[1] != local:
                loaded = loaded[:, rank * local:(rank + 1) * local]
        copy_checked(target, loaded, f"expert {expert}")

    def extra_repr(self) -> str:
        return (f"experts={self.first_expert}:{self.first_expert + self.local_experts} of {self.num_experts}, "
                f"intermediate={self.intermediate}, tp={self.parallel.tp_size}, ep={self.expert_parallel}")


class MoEMLP(nn.Module):
    """`x [T, H]` -> `[T, H]`: the router's softmax top-k over the experts, the chosen experts' gated MLPs weighted
    and summed (one fused kernel), plus the shared expert times sigmoid(its gate) where there is one."""

    def __init__(self, arch: DecoderArch, dtype: torch.dtype, quant_method: QuantMethodFor, prefix: str,
                 parallel: ParallelContext, dense_mlp: Callable[[DecoderArch, str], nn.Module]) -> None:
        super().__init__()
        moe = arch.moe
        assert moe is not None
        # A quantization scheme without a method for expert layers refuses here, naming the layer.
        quant_method(f"{prefix}.experts", (), kind=FUSED_MOE)
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.activation = arch.activation
        self.parallel = parallel
        self.router_name = moe.router
        # The router stays in the model dtype: its top-k choice is sensitive to rounding.
        self.add_module(moe.router, ReplicatedLinear(arch.hidden_size, moe.num_experts, bias=False,
                                                     quant_method=UnquantizedLinearMethod(), params_dtype=dtype))
        self.experts = FusedExperts(moe, arch.hidden_size, dtype, f"{prefix}.experts", parallel)
        self.has_shared_expert = moe.shared_expert_size > 0
        if self.has_shared_expert:
            shared = dataclasses.replace(arch, intermediate_size=moe.shared_expert_size, mlp_bias=False)
            self.shared_expert = dense_mlp(shared, f"{prefix}.shared_expert")
            self.shared_expert_gate = ReplicatedLinear(arch.hidden_size, 1, bias=False,
                                                       quant_method=UnquantizedLinearMethod(), params_dtype=dtype)

    @property
    def in_proj(self) -> LinearBase:
        """What the norm before the block feeds: the router (model-dtype input; the experts take the same)."""
        return getattr(self, self.router_name)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) of each token's chosen experts."""
        probs = F.softmax(self.in_proj(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor, fuse: bool = True) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.experts.expert_parallel:
            ids = self.experts.local_ids[ids]
        out = ops.fused_moe(x, self.experts.w13_weight, self.experts.w2_weight, weights, ids, self.activation)
        if self.parallel.tp_size > 1:
            out = self.parallel.all_reduce(out)
        if self.has_shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
