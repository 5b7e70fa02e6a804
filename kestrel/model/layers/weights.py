"""The parameter tags that tell a layer's loader how to slice a checkpoint tensor, and the checked copy every
loader ends with.

A QuantMethod's `create_weights` registers parameters on its layer and tags them (plain attributes on the
`nn.Parameter`); `LinearBase.weight_loader` reads the tags to place merged shards (q/k/v, gate/up) and to take
a tensor-parallel rank's slice, so a new storage layout needs no loader or model edit:

- `output_dim` (int): the dim that runs along output features. Merged shards are placed along it; a
  column-parallel layer splits it across ranks.
- `input_dim` (int): the dim that runs along input features; a row-parallel layer splits it across ranks.
- `packed_dim` (int) and `packed_factor` (int): the tensor stores `packed_factor` values per element along
  `packed_dim` (e.g. eight int4 values in one int32 along the input dim, `[N, K / 8]`): offsets and sizes along
  that dim are divided by the factor.
- `group_size` (int): the tensor has one entry per `group_size` input features along its `input_dim` (group
  scales or zero points, `[N, K / group_size]`): offsets and sizes along that dim are divided by it.
- `per_shard=True`: one entry per merged shard along dim 0 (e.g. a per-tensor scale of each of q, k and v),
  indexed by the shard id and never split across ranks.
- `checkpoint_optional=True`: the tensor may be absent from a checkpoint (e.g. a static activation scale).
- `weight_loader(param, loaded_weight, shard_id=None)`: the parameter's own loader; without one the layer's
  sharding-aware loader is used.

A merged shard's place or a rank's slice that would cut a packed element or a group is a ValueError: the
method chose a layout the layer sizes (or `tp_size`) do not divide.
"""

from __future__ import annotations

import torch


class WeightShapeError(ValueError):
    """A checkpoint tensor does not fit the parameter (slice) it is loaded into."""

    def __init__(self, loaded_shape: tuple[int, ...], expected_shape: tuple[int, ...], detail: str = "") -> None:
        self.loaded_shape = loaded_shape
        self.expected_shape = expected_shape
        where = f" ({detail})" if detail else ""
        super().__init__(f"checkpoint shape {loaded_shape} does not match parameter shape {expected_shape}{where}")


def features_per_element(param: torch.Tensor, dim: int) -> int:
    """How many input or output features one stored element of `param` covers along `dim` (1 when unpacked
    and ungrouped there)."""
    factor = 1
    if getattr(param, "packed_dim", None) == dim:
        factor *= int(param.packed_factor)
    group_size = getattr(param, "group_size", None)
    if group_size and getattr(param, "input_dim", None) == dim:
        factor *= int(group_size)
    return factor


def stored_span(param: torch.Tensor, dim: int, offset: int, size: int) -> tuple[int, int]:
    """(offset, size) counted in features along `dim` -> counted in `param`'s stored elements."""
    factor = features_per_element(param, dim)
    if offset % factor or size % factor:
        raise ValueError(f"features [{offset}, {offset + size}) along dim {dim} cut a packed element or a group of "
                         f"{factor} of a parameter of shape {tuple(param.shape)}")
    return offset // factor, size // factor


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, detail: str = "") -> None:
    """Copy `loaded` into `target` (a parameter or a view of one), failing with both shapes on mismatch."""
    if tuple(loaded.shape) != tuple(target.shape):
        # Per-tensor scales are stored as [] or [1] depending on the writer; both mean one value.
        if not (loaded.numel() == 1 and target.numel() == 1):
            raise WeightShapeError(tuple(loaded.shape), tuple(target.shape), detail)
        loaded = loaded.reshape(target.shape)
    target.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Whole-tensor copy for parameters that are neither merged nor split."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not merged; got shard id {shard_id!r}")
    copy_checked(param.data, loaded_weight)
