"""Activations for the MLP (gated, and plain for non-gated MLPs), each with its fused quantizing producer.

`[..., 2*I]` (gate then up, as gate_up_proj lays them out) -> `act(gate) * up` of `[..., I]`, computed in fp32
and rounded once, in one `ops` launch. `feed` hands the result to the next linear layer in the form that layer
asks for (`LinearBase.input_quant(num_tokens)`): quantized in the same launch when it takes 8-bit input.
"""

from __future__ import annotations

import torch
from torch import nn

from kestrel import ops
from kestrel.config import ConfigError
from kestrel.model.layers.linear import LinearBase
from kestrel.quant.base import InputQuant, QuantAct


def activation_from_hf(name: str) -> str:
    """config.json `hidden_act` (transformers' ACT2FN names) -> ours."""
    try:
        return ops.HF_ACTIVATIONS[name]
    except KeyError:
        raise ConfigError(f"unsupported hidden_act={name!r} in config.json; supported: "
                          f"{sorted(ops.HF_ACTIVATIONS)}") from None


class Activation(nn.Module):
    """`act(x)` for a plain (non-gated) MLP, computed in fp32 and rounded once."""

    def __init__(self, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ops.ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose from {ops.ACTIVATIONS}")
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.act(x, self.activation)

    def quantized(self, x: torch.Tensor, spec: InputQuant) -> QuantAct:
        return ops.act_quant(x, self.activation, spec.dtype, spec.scale, spec.azp, spec.symmetric)

    def feed(self, x: torch.Tensor, consumer: LinearBase, fuse: bool = True) -> torch.Tensor | QuantAct:
        """`forward(x)` in the form `consumer` takes: quantized in the same launch when it asks for it."""
        spec = consumer.input_quant(x.numel() // x.shape[-1]) if fuse else None
        return self(x) if spec is None else self.quantized(x, spec)

    def extra_repr(self) -> str:
        return self.activation


class GatedActivation(Activation):
    """`act(gate) * up` of `[..., 2*I]` (gate then up, as gate_up_proj lays them out)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.act_mul(x, self.activation)

    def quantized(self, x: torch.Tensor, spec: InputQuant) -> QuantAct:
        return ops.act_mul_quant(x, self.activation, spec.dtype, spec.scale, spec.azp, spec.symmetric)
