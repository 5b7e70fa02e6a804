"""Helpers shared by the layers' weight loaders: checked copies that name both shapes on mismatch."""

from __future__ import annotations

import torch


class WeightShapeError(ValueError):
    """A checkpoint tensor does not fit the parameter (slice) it is loaded into."""

    def __init__(self, loaded_shape: tuple[int, ...], expected_shape: tuple[int, ...], detail: str = "") -> None:
        self.loaded_shape = loaded_shape
        self.expected_shape = expected_shape
        where = f" ({detail})" if detail else ""
        super().__init__(f"checkpoint shape {loaded_shape} does not match parameter shape {expected_shape}{where}")


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
