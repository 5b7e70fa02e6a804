"""Dense float32 linear layers on the CPU through oneDNN (`torch.ops.mkldnn._linear_pointwise`, the op inductor's CPU
backend emits) in place of `F.linear`'s MKL sgemm: on the development machine's AMD EPYC (AVX-512) it ran kestrel-
tiny's shapes about 2x faster from 16 rows up (thread CPU time, docs/benchmarks.md "CPU backend").

A layer's weight may come packed (`pack_weight`, done once at load by the unquantized linear method): oneDNN's own
blocked layout, which it otherwise re-creates from the plain weight on every call (15-40% of a call at decode
sizes). With a packed weight, 4 to 15 rows also go through oneDNN (padded to 16), where they beat MKL.

oneDNN keeps a compiled primitive (about 0.5-2.5 MB) per distinct (rows, N, K), so an engine whose batch size
changes every step would grow without bound. Every call therefore runs on row counts from a few buckets (powers of
two, 16 ... 2048): an input runs in 2048-row pieces, then its remainder either padded up to its bucket (when that
wastes at most an eighth of it, or it is under 64 rows) or cut into the next-smaller bucket and the rest, so at most
len(ROW_BUCKETS) = 8 primitives exist per weight shape and little padding is computed. (Two buckets per octave ran
a server soak ~5% past its 100 MB growth bound; the large-row primitives cost the most.) Sums are reordered, so
results differ from `F.linear` by float32 rounding; padded rows are zeros and are dropped. Anything else (other
dtypes, autograd, a torch without oneDNN) takes `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MIN_ROWS = 16  # fewer rows take F.linear on a plain weight
MIN_PACKED_ROWS = 4  # fewer rows take F.linear even when the weight is packed (one row streams the weight as fast)
MAX_ROWS = 2048
ROW_BUCKETS: tuple[int, ...] = tuple(1 << p for p in range(MIN_ROWS.bit_length() - 1, MAX_ROWS.bit_length()))
SPLIT_FROM_ROWS = 64  # a remainder at least this long is cut rather than padded when padding would waste > 1/8


@functools.cache
def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] in oneDNN's blocked layout for `linear_cpu(packed=...)`, or None where the fast path does not
    apply (not a contiguous float32 CPU matrix, or no oneDNN). The plain weight stays the layer's parameter."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2
            or not weight.is_contiguous() or weight.numel() == 0 or not onednn_available()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def row_bucket(rows: int) -> int:
    """The smallest bucket holding `rows` (rows <= MAX_ROWS)."""
    return next(b for b in ROW_BUCKETS if b >= rows)


@functools.lru_cache(maxsize=4096)
def row_pieces(rows: int) -> tuple[tuple[int, int, int], ...]:
    """(start, rows, bucket) of each oneDNN call for an input of `rows` rows: full MAX_ROWS pieces, then the rest
    padded to its bucket or cut in two as the module docstring says."""
    pieces, start = [], 0
    while start < rows:
        left = rows - start
        if left >= MAX_ROWS:
            count, bucket = MAX_ROWS, MAX_ROWS
        else:
            bucket = row_bucket(left)
            if left < SPLIT_FROM_ROWS or (bucket - left) * 8 <= bucket:
                count = left
            else:
                count = bucket = bucket // 2
        pieces.append((start, count, bucket))
        start += count
    return tuple(pieces)


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               packed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for CPU tensors; `packed`: `pack_weight(weight)`, when the layer keeps one."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows < (MIN_ROWS if packed is None else MIN_PACKED_ROWS) or x.dtype != torch.float32
            or weight.dtype != torch.float32 or (bias is not None and bias.dtype != x.dtype) or weight.dim() != 2
            or not weight.is_contiguous() or not onednn_available()
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    matrix = weight if packed is None else packed
    pieces = row_pieces(rows)
    if len(pieces) == 1 and pieces[0][2] == rows and flat.is_contiguous():
        return _onednn_linear(flat, matrix, bias).view(*x.shape[:-1], weight.shape[0])
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype)
    for start, count, bucket in pieces:
        part = flat[start:start + count]
        if bucket != count or not part.is_contiguous():
            padded = part.new_empty(bucket, part.shape[1])
            padded[:count] = part
            padded[count:].zero_()
            part = padded
        out[start:start + count] = _onednn_linear(part, matrix, bias)[:count]
    return out.view(*x.shape[:-1], weight.shape[0])
