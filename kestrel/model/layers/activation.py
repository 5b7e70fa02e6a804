"""Gated activations for the MLP."""

from __future__ import annotations

import torch
from torch import nn

from kestrel import ops


class SiluAndMul(nn.Module):
    """`[..., 2*I]` (gate then up, as gate_up_proj lays them out) -> `silu(gate) * up` of `[..., I]`, computed
    in fp32 and rounded once (one `ops.silu_mul` launch)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_mul(x)
