"""Random weights for any model: no checkpoint needed, seeded, small enough that activations stay finite."""

from __future__ import annotations

import torch
from torch import nn

from kestrel.model.layers.linear import process_linear_layer
from kestrel.model.layers.norm import LayerNorm, RMSNorm


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02,
                             device: str | torch.device | None = None) -> None:
    """Fill every parameter: N(0, std) for weights and biases, 1 + N(0, std) for norm scales
    (so hidden states are not shrunk layer after layer), random integers for integer tensors.
    Values are drawn on the parameters' device (an 8B model in seconds on a GPU, minutes on its host), so a
    seed gives the same model on every run on that kind of device, not across devices.

    A parameter on the meta device (the high-precision weight of a layer quantized at load, see
    `QuantPlan.random_weights`) is created on `device`, filled, and its layer quantized as soon as its last such
    parameter is filled: at most one layer's high-precision weight exists at a time. The values are those the
    same seed gives the model built without deferral (parameters are drawn in the same order)."""
    generators: dict[torch.device, torch.Generator] = {}
    # Scales multiply (Gemma's unit-offset RMSNorm stores scale - 1, which is drawn like any weight).
    norm_weights = {id(m.weight) for m in model.modules()
                    if isinstance(m, LayerNorm) or (isinstance(m, RMSNorm) and not m.unit_offset)}
    owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    deferred: dict[int, int] = {}  # id(layer) -> its meta parameters not yet filled
    for param in model.parameters():
        if param.is_meta:
            if device is None:
                raise ValueError("parameters on the meta device need a device to be created on")
            deferred[id(owners[id(param)])] = deferred.get(id(owners[id(param)]), 0) + 1
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        owner = owners[id(param)]
        if param.is_meta:
            param = _materialize(owner, name.rsplit(".", 1)[-1], param, torch.device(device))
        target = param.device
        if target not in generators:
            generators[target] = torch.Generator(target).manual_seed(seed)
        generator = generators[target]
        if param.dtype.is_floating_point and param.element_size() >= 2:
            values = torch.randn(param.shape, generator=generator, device=target).mul_(std)
            if id(param) in norm_weights:
                values += 1.0
        elif param.dtype.is_floating_point:  # 8-bit floats
            values = torch.randn(param.shape, generator=generator, device=target).clamp_(-4, 4)
        else:
            values = torch.randint(-8, 8, param.shape, generator=generator, device=target)
        param.data.copy_(values.to(param.dtype))
        del values
        if id(owner) in deferred:
            deferred[id(owner)] -= 1
            if not deferred[id(owner)] and hasattr(owner, "process_after_loading"):  # linear layers, experts
                process_linear_layer(owner)


def _materialize(module: nn.Module, local_name: str, meta: nn.Parameter, device: torch.device) -> nn.Parameter:
    """An uninitialized `meta`-shaped parameter on `device` in place of `meta`, with its loader attributes."""
    param = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=device), requires_grad=False)
    param.__dict__.update(meta.__dict__)
    setattr(module, local_name, param)
    return param
