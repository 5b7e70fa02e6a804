"""Integer weight grids of the weight-only quantizer (`kestrel quantize --scheme w4a16 | w8a16`): per-group (or
per-channel) scales and zero points, integer codes, round-to-nearest, and the compressed-tensors `pack-quantized`
tensors they are written as.

The grid is compressed-tensors' min-max one, so the codes written here dequantize in its loader (and in kestrel's,
`kestrel.quant.wna16`) to exactly the weights the quantizer optimized: signed codes q in [-2^(b-1), 2^(b-1) - 1],
W = (q - z) * s per group of `group_size` input features. Symmetric: s = max|W| / ((qmax - qmin) / 2), z = 0.
Asymmetric: [min, max] widened to hold 0, s = (max - min) / (qmax - qmin), z = round(qmin - min / s) clamped.
The scale is rounded to the dtype it is stored in (the checkpoint's) before any code is chosen, so rounding and
error compensation (GPTQ) see the stored grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.config import ConfigError
from kestrel.quant.wna16 import BITS, GROUP_MULTIPLE


@dataclass(frozen=True)
class IntGrid:
    bits: int
    group_size: int  # -1: one group per output channel (the whole row)
    symmetric: bool
    scale_dtype: torch.dtype = torch.float32  # how the scales are stored

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ConfigError(f"invalid bits={self.bits}: weight-only grids have {list(BITS)} bits")
        if self.group_size != -1 and (self.group_size <= 0 or self.group_size % GROUP_MULTIPLE):
            raise ConfigError(f"invalid group_size={self.group_size}: expected -1 (per channel) or a positive "
                              f"multiple of {GROUP_MULTIPLE} (the weight-only kernel's K step)")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def group(self, K: int) -> int:
        return K if self.group_size == -1 else self.group_size

    def params(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scale and zero point `[N]` (in w's dtype, integer-valued zeros; None when symmetric) of the rows of one
        group `w [N, g]`."""
        lo = w.amin(1).clamp_max(0)
        hi = w.amax(1).clamp_min(0)
        span = float(self.qmax - self.qmin)
        scale = torch.maximum(-lo, hi) / (span / 2) if self.symmetric else (hi - lo) / span
        scale = scale.to(self.scale_dtype)
        # An all-zero group: any positive scale codes it exactly.
        scale = torch.where(scale == 0, torch.finfo(self.scale_dtype).eps, scale).to(w.dtype)
        if self.symmetric:
            return scale, None
        return scale, torch.round(self.qmin - lo / scale).clamp(self.qmin, self.qmax)

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """Codes (in w's dtype, integer-valued) of `w [N]` or `[N, g]` with per-row `scale` / `zero` `[N]`."""
        if w.dim() == 2:
            scale = scale[:, None]
            zero = None if zero is None else zero[:, None]
        q = torch.round(w / scale)
        if zero is not None:
            q = q + zero
        return q.clamp(self.qmin, self.qmax)

    @staticmethod
    def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        if q.dim() == 2:
            scale = scale[:, None]
            zero = None if zero is None else zero[:, None]
        return (q if zero is None else q - zero) * scale


@dataclass(frozen=True)
class QuantizedLinear:
    """One linear module's integer weights: codes `[N, K]`, scales `[N, G]` (the grid's scale dtype), zero points
    `[N, G]` (None when symmetric)."""

    codes: torch.Tensor  # int8
    scale: torch.Tensor
    zero: torch.Tensor | None  # int8
    grid: IntGrid

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        N, K = self.codes.shape
        g = self.grid.group(K)
        scale = self.scale.to(dtype).repeat_interleave(g, 1)
        q = self.codes.to(dtype)
        if self.zero is not None:
            q = q - self.zero.to(dtype).repeat_interleave(g, 1)
        return q * scale

    def compressed_tensors(self, module: str) -> dict[str, torch.Tensor]:
        """The module's `pack-quantized` tensors: `weight_packed` int32 `[N, K * b / 32]` (codes + 2^(b-1) packed
        along K, value i at bits b*i), `weight_scale [N, G]`, `weight_shape`, and (asymmetric) `weight_zero_point`
        int32 `[ceil(N * b / 32), G]` packed along N."""
        N, K = self.codes.shape
        bits = self.grid.bits
        out = {f"{module}.weight_packed": pack_int32(self.codes.to(torch.int32) - self.grid.qmin, bits),
               f"{module}.weight_scale": self.scale.contiguous(),
               f"{module}.weight_shape": torch.tensor([N, K], dtype=torch.int64)}
        if self.zero is not None:
            zeros = self.zero.to(torch.int32).T - self.grid.qmin  # [G, N]: packed along N
            out[f"{module}.weight_zero_point"] = pack_int32(zeros, bits).T.contiguous()
        return out


def check_groups(grid: IntGrid, module: str, K: int) -> None:
    if grid.group_size != -1 and K % grid.group_size:
        raise ConfigError(f"invalid group_size={grid.group_size} for {module!r}: its {K} input features are not "
                          "whole groups; choose a group size that divides every layer's input features, or -1 (per "
                          "channel)")


# Clipping search: the group's range shrunk by each of these factors, the best kept per row and group.
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(10))


def group_params(w: torch.Tensor, grid: IntGrid, hessian: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales and zero points `[N, G]` of `w [N, K]`: the min-max grid of each group, or with `hessian` (x x^T
    summed over the layer's inputs) the range among `CLIP_RATIOS` of it that minimizes each row's output error from
    that group alone, d H_gg d^T (AWQ's clipping search, on the group's diagonal block of H)."""
    N, K = w.shape
    g = grid.group(K)
    scales, zeros = [], []
    for start in range(0, K, g):
        wg = w[:, start:start + g]
        scale, zero = grid.params(wg)
        if hessian is not None:
            block = hessian[start:start + g, start:start + g].to(w.dtype)
            best = None
            for ratio in CLIP_RATIOS:
                s, z = grid.params(wg * ratio)
                d = wg - grid.dequantize(grid.quantize(wg, s, z), s, z)
                err = ((d @ block) * d).sum(1)
                if best is None:
                    best, scale, zero = err, s, z
                    continue
                better = err < best
                best = torch.where(better, err, best)
                scale = torch.where(better, s, scale)
                zero = None if z is None else torch.where(better, z, zero)
        scales.append(scale)
        zeros.append(zero)
    return torch.stack(scales, 1), None if grid.symmetric else torch.stack(zeros, 1)


def rtn(weight: torch.Tensor, grid: IntGrid, hessian: torch.Tensor | None = None) -> QuantizedLinear:
    """Round to nearest on each group's grid (`group_params`: min-max, or clipped by the output error)."""
    w = weight.float()
    scales, zeros = group_params(w, grid, hessian)
    g = grid.group(w.shape[1])
    codes = torch.cat([grid.quantize(w[:, j * g:(j + 1) * g], scales[:, j], None if zeros is None else zeros[:, j])
                       for j in range(scales.shape[1])], 1)
    return finish(codes, scales, zeros, grid)


def finish(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, grid: IntGrid) -> QuantizedLinear:
    return QuantizedLinear(codes.to(torch.int8), scale.to(grid.scale_dtype),
                           None if zero is None else zero.to(torch.int8), grid)


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned `values [R, C]` (each < 2^bits) into int32 words along C, value i of a word at bits bits*i; C is
    padded with zeros to whole words."""
    per_word = 32 // bits
    R, C = values.shape
    padded = -(-C // per_word) * per_word
    v = torch.nn.functional.pad(values.to(torch.int64), (0, padded - C)).reshape(R, padded // per_word, per_word)
    words = (v << (torch.arange(per_word, dtype=torch.int64, device=v.device) * bits)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
