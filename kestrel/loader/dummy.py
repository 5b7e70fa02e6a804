"""Random weights for any model: no checkpoint needed, seeded, small enough that activations stay finite."""

from __future__ import annotations

import torch
from torch import nn

from kestrel.model.layers.norm import RMSNorm


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every parameter: N(0, std) for weights and biases, 1 + N(0, std) for norm scales
    (so hidden states are not shrunk layer after layer), random integers for integer tensors.
    Values are drawn on the parameters' device (an 8B model in seconds on a GPU, minutes on its host), so a
    seed gives the same model on every run on that kind of device, not across devices."""
    generators: dict[torch.device, torch.Generator] = {}
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device).manual_seed(seed)
        generator = generators[device]
        if param.dtype.is_floating_point and param.element_size() >= 2:
            values = torch.randn(param.shape, generator=generator, device=device).mul_(std)
            if id(param) in norm_weights:
                values += 1.0
        elif param.dtype.is_floating_point:  # 8-bit floats
            values = torch.randn(param.shape, generator=generator, device=device).clamp_(-4, 4)
        else:
            values = torch.randint(-8, 8, param.shape, generator=generator, device=device)
        param.data.copy_(values.to(param.dtype))
        del values
