"""The decoder layers a compile-ahead dry run needs: one of each kind.

A dry forward (`kestrel.kernels.compile_ahead`) only records the kernel specializations its launches would compile,
and layers built alike launch the same ones: the 32 layers of an 8B model differ in their weights' addresses and in
their names, never in a shape, a dtype or a setting. Running one layer of each kind cuts the dry runs of a
start-up (a forward per captured graph) to a few layers each. A kind is read from everything a layer holds that a
launch could specialize on: each submodule's class, its tensors' shapes, dtypes and strides, its integer, boolean
and string settings; and whether it is the stack's first layer, the one whose input has no residual stream yet.
Attributes that name or scale a layer (`IDENTITY_ATTRS`) are left out; any other attribute that
differs keeps both layers, so a layer whose launches differ is never skipped, and a kind missed would only compile
where it first launches.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

# Per-layer values that reach no kernel's specialization: the layer's index and checkpoint prefix (host-side
# bookkeeping) and the FP8 KV scales (float kernel arguments, which Triton does not specialize on).
IDENTITY_ATTRS = frozenset({"layer_idx", "prefix", "k_scale", "v_scale"})


def _summary(value: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, tuple(value.stride()) if value.layout == torch.strided
                else None)
    if isinstance(value, bool | int | float | str | type(None) | torch.dtype):
        return value
    if isinstance(value, tuple | list) and depth < 3:
        return tuple(_summary(v, depth + 1) for v in value)
    if isinstance(value, dict) and depth < 3:
        return tuple(sorted((str(k), _summary(v, depth + 1)) for k, v in value.items()))
    return type(value).__qualname__


def layer_kind(layer: nn.Module) -> tuple:
    """What a layer's launches may depend on, besides the step's inputs (see the module's docstring)."""
    parts = []
    for name, module in layer.named_modules():
        attrs = tuple(sorted((key, _summary(value)) for key, value in vars(module).items()
                             if key not in IDENTITY_ATTRS and key not in ("_modules", "_forward_pre_hooks",
                                                                            "_forward_hooks")))
        parts.append((name, type(module).__qualname__, attrs))
    return tuple(parts)


def decoder_stacks(model: nn.Module) -> list[nn.Module]:
    """The modules that run a stack of decoder layers by index (`stage_layers` over `layers`)."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "stage_layers", None), range | list) and isinstance(getattr(m, "layers", None),
                                                                                      nn.ModuleList)]


@contextmanager
def one_layer_of_each_kind(model: nn.Module) -> Iterator[int]:
    """Within the block every decoder stack of `model` runs its first layer and the first of each kind after it
    only; yields how many layers it leaves out. For dry runs alone: the forwards it shortens compute nothing right."""
    saved = []
    left_out = 0
    try:
        for stack in decoder_stacks(model):
            first: dict[tuple, int] = {}
            start = stack.stage_layers[0] if len(stack.stage_layers) else None
            for i in stack.stage_layers:
                # The stack's first layer gets no residual stream (its norm adds none), the others get one.
                first.setdefault((i == start, layer_kind(stack.layers[i])), i)
            kept = sorted(first.values())
            saved.append((stack, stack.stage_layers))
            left_out += len(stack.stage_layers) - len(kept)
            stack.stage_layers = kept
        yield left_out
    finally:
        for stack, layers in saved:
            stack.stage_layers = layers
