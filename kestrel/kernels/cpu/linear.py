"""Dense float32 linear layers on the CPU through oneDNN (`torch.ops.mkldnn._linear_pointwise`, the op inductor's CPU
backend emits) in place of `F.linear`'s MKL sgemm: on the development machine's AMD EPYC (AVX-512) it ran kestrel-
tiny's shapes about 2x faster from 16 rows up (thread CPU time, docs/benchmarks.md "CPU backend").

oneDNN keeps a compiled primitive (about 0.5-2.5 MB) per distinct (rows, N, K), so an engine whose batch size
changes every step would grow without bound. Rows are therefore padded up to the next power of two (16, 32, ...
2048) and a larger input runs in 2048-row slices: at most len(ROW_BUCKETS) = 8 primitives per weight shape. (Two
buckets per octave ran a server soak ~5% past its 100 MB growth bound; the large-row primitives cost the most.)
Fewer than 16 rows take `F.linear` (no primitive). Sums are reordered, so results differ from `F.linear` by float32
rounding; padded rows are zeros and are dropped. Anything else (other dtypes, autograd, a torch without oneDNN)
takes `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MIN_ROWS = 16
MAX_ROWS = 2048
ROW_BUCKETS: tuple[int, ...] = tuple(1 << p for p in range(MIN_ROWS.bit_length() - 1, MAX_ROWS.bit_length()))


@functools.cache
def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def row_bucket(rows: int) -> int:
    """The smallest bucket holding `rows` (MIN_ROWS <= rows <= MAX_ROWS)."""
    return next(b for b in ROW_BUCKETS if b >= rows)


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for CPU tensors."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows < MIN_ROWS or x.dtype != torch.float32 or weight.dtype != torch.float32
            or (bias is not None and bias.dtype != x.dtype) or weight.dim() != 2 or not weight.is_contiguous()
            or not onednn_available() or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype)
    for start in range(0, rows, MAX_ROWS):
        part = flat[start:start + MAX_ROWS]
        count = part.shape[0]
        if count < MIN_ROWS:
            out[start:] = F.linear(part, weight, bias)
            break
        bucket = row_bucket(count)
        if bucket != count or not part.is_contiguous():
            padded = part.new_empty(bucket, part.shape[1])
            padded[:count] = part
            padded[count:].zero_()
            part = padded
        out[start:start + count] = _onednn_linear(part, weight, bias)[:count]
    return out.view(*x.shape[:-1], weight.shape[0])
