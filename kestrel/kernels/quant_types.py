"""The type the quantizing kernels return. Kept apart from the kernel modules (no Triton functions here), so
the one class stays the same object when a test reloads the kernels in the interpreter."""

from __future__ import annotations

from typing import NamedTuple

import torch


class QuantAct(NamedTuple):
    """Quantized activations: q `[M, K]`, scale `[M, 1]` fp32 (or the given per-tensor scale), azp `[M]`
    int32 (or the given per-tensor zero point) for asymmetric INT8, else None."""

    q: torch.Tensor
    scale: torch.Tensor
    azp: torch.Tensor | None
