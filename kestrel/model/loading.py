"""Family-agnostic checkpoint loading: a model declares its checkpoint layout as data, this module does the rest.

A model declares
- `packed_modules_mapping`: our merged module -> the checkpoint modules it stacks, in shard order
  (`{"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}`); the shard id of
  part i is the merged layer's `shard_ids[i]`;
- `skipped_checkpoint_suffixes`: tensors a checkpoint may carry that are no parameters here (rotary tables,
  FP8 KV scales the worker reads);
- `checkpoint_target(name)`: the checkpoint name a tensor loads under in this rank's model, or None when it
  belongs elsewhere (another pipeline stage, a tied head).
Each parameter's own `weight_loader` does the sharding (tensor parallelism, merged shards); parameters tagged
`checkpoint_optional` may be absent. A parameter that stacks many checkpoint tensors under names the mapping
cannot express (a mixture-of-experts layer's experts, `model.layers.0.mlp.experts.5.up_proj.weight`) declares them
itself: `checkpoint_shards`, checkpoint name -> (shard id, the tensor's shape in the checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import torch
from torch import nn

from kestrel.model.layers.weights import WeightShapeError


class WeightLoadingError(ValueError):
    """The checkpoint does not fit the model: missing, unexpected or mis-shaped tensors."""


class DeclaresCheckpoint(Protocol):
    packed_modules_mapping: Mapping[str, tuple[str, ...]]
    skipped_checkpoint_suffixes: tuple[str, ...]

    def checkpoint_target(self, hf_name: str) -> str | None: ...


def renamed_by_prefix(hf_name: str, renames: Iterable[tuple[str, str]]) -> str:
    """`hf_name` with the first of `renames`' (old prefix, new prefix) pairs it starts with replaced; unchanged
    when none matches (a checkpoint layout mapped onto kestrel's names)."""
    for old, new in renames:
        if hf_name.startswith(old):
            return new + hf_name[len(old):]
    return hf_name


def to_param_name(hf_name: str, packed: Mapping[str, tuple[str, ...]]) -> tuple[str, str | None, int | None]:
    """(our parameter name, the merged module it goes into or None, the part's index among the merged ones)."""
    for merged, parts in packed.items():
        for index, part in enumerate(parts):
            if f".{part}." in hf_name:
                return hf_name.replace(f".{part}.", f".{merged}."), merged, index
    return hf_name, None, None


def checkpoint_names(param_name: str, param: nn.Parameter, packed: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The checkpoint tensor names that together fill `param` (three for a qkv weight, two for gate_up)."""
    if getattr(param, "checkpoint_optional", False):
        return []
    if hasattr(param, "checkpoint_shards"):
        return list(param.checkpoint_shards)
    for merged, parts in packed.items():
        if f".{merged}." in param_name:
            return [param_name.replace(f".{merged}.", f".{part}.") for part in parts]
    return [param_name]


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors in through each parameter's weight_loader and check that every parameter was
    loaded. The quant methods' post-processing is the caller's next step."""
    declared: DeclaresCheckpoint = model  # type: ignore[assignment]
    packed = declared.packed_modules_mapping
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    expected = {hf for name, param in params.items() for hf in checkpoint_names(name, param, packed)}
    declared_shards = {hf: (name, shard) for name, param in params.items()
                       for hf, (shard, _) in getattr(param, "checkpoint_shards", {}).items()}
    seen: set[str] = set()
    with torch.no_grad():
        for hf_name, tensor in weights:
            if hf_name.endswith(declared.skipped_checkpoint_suffixes):
                continue
            target = declared.checkpoint_target(hf_name)
            if target is None:
                continue
            if target in declared_shards:
                name, shard_id = declared_shards[target]
                param = params[name]
            else:
                name, merged, index = to_param_name(target, packed)
                param = params.get(name)
                if param is None:
                    raise WeightLoadingError(
                        f"checkpoint tensor {hf_name!r} has no matching parameter in {type(model).__name__}")
                shard_id = None
                if merged is not None:
                    shard_id = modules[name.rsplit(".", 1)[0]].shard_ids[index]
            try:
                param.weight_loader(param, tensor, shard_id)
            except WeightShapeError as e:
                raise WeightLoadingError(
                    f"tensor {hf_name!r}: checkpoint shape {e.loaded_shape} does not match the model's "
                    f"{e.expected_shape}") from e
            seen.add(target)
    missing = sorted(expected - seen)
    if missing:
        shown = ", ".join(missing[:20]) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
        raise WeightLoadingError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


def checkpoint_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape of an unsharded, unquantized model (built on the meta device, say): what
    a checkpoint of it holds, in parameter order."""
    declared: DeclaresCheckpoint = model  # type: ignore[assignment]
    packed = declared.packed_modules_mapping
    modules = dict(model.named_modules())
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters():
        if hasattr(param, "checkpoint_shards"):
            shapes.update({hf: tuple(shape) for hf, (_, shape) in param.checkpoint_shards.items()})
            continue
        names = checkpoint_names(name, param, packed)
        if len(names) == 1 and names[0] == name:
            shapes[name] = tuple(param.shape)
            continue
        layer = modules[name.rsplit(".", 1)[0]]
        dim = getattr(param, "output_dim", 0)
        for hf_name, size in zip(names, layer.output_partition_sizes, strict=True):
            shape = list(param.shape)
            shape[dim] = size
            shapes[hf_name] = tuple(shape)
    return shapes
