"""Gated activations for the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """`[..., 2*I]` (gate then up, as gate_up_proj lays them out) -> `silu(gate) * up` of `[..., I]`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
