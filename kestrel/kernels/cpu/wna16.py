"""The weight-only GEMM on the CPU. int4 / uint4 weights run in `wna16.c` (built by `native.py`): one pass over the
packed words for a few rows (decode); for more, the float32 weight dequantized one column chunk at a time into one
reused buffer, each chunk's matmul writing its columns (the whole weight, as `wna16_gemm_ref` makes it, is a fresh
allocation of K x N floats a call, its pages faulted in each time). int8 weights take the same column chunks,
dequantized by torch ops, at any row count. Other weight types, gradients, tensors off the CPU or (for the 4-bit
types) no C compiler take `wna16_gemm_ref`, which stays the tests' oracle. The many-row path multiplies the
reference's float32 weight; the few-row path sums the exact products (c - z) * x per group and scales each group's
sum once, where the reference rounds every x * s * (c - z): both float32-accurate, not bit-identical. Float offsets
(int4 with mins, w = s * (c - 8) - m) run the C code without them and subtract each group's activation sums times
the offsets after, one small matmul."""

from __future__ import annotations

import torch

from kestrel.kernels import wna16 as _wna16
from kestrel.kernels.cpu import native

# Rows up to which one pass over the packed words beats dequantizing the weight for a matmul (2-core development
# machine, Qwen2-0.5B's linear shapes).
GEMV_ROWS = 16
CHUNK_COLUMNS = 512  # of the dequantized weight at a time: K x 512 floats (2 MB at K = 1024, 10 MB at K = 4864)
WEIGHT_TYPES = ("int4", "uint4")  # uint4 always comes with its zero points; int4 is the codes minus 8
_INT4_ZERO = 8.0


def wna16_gemm_cpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   perm: torch.Tensor | None, weight_type: str, out_dtype: torch.dtype,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """`wna16_gemm_ref`'s result; see the module docstring."""
    K, N, group = _wna16.check_args(x, qweight, scales, zeros, perm, weight_type, out_dtype, bias)
    M = x.shape[0]
    few = M <= GEMV_ROWS
    fn = (native.w4_gemv_fn() if few else native.w4_dequant_fn()) if weight_type in WEIGHT_TYPES else None
    eight_bit = weight_type == "int8"
    tensors = [t for t in (x, qweight, scales, zeros, perm, bias) if t is not None]
    if ((fn is None and not eight_bit) or M == 0 or any(t.device.type != "cpu" for t in tensors)
            or (torch.is_grad_enabled() and (x.requires_grad or scales.requires_grad))):
        return _wna16.wna16_gemm_ref(x, qweight, scales, zeros, perm, weight_type, out_dtype, bias)
    xs = x.float()
    if perm is not None:
        xs = xs.index_select(1, perm)
    xs = xs.contiguous()
    words = qweight.contiguous()
    sc = scales.float().contiguous()
    mins = zeros if _wna16.has_mins(zeros) else None
    zs = zeros.to(torch.int8).contiguous() if zeros is not None and mins is None else None
    z_ptr = zs.data_ptr() if zs is not None else None
    threads = torch.get_num_threads()
    out = torch.empty(M, N, dtype=torch.float32)
    if eight_bit:
        status = _chunked_matmul(xs, out, lambda w, n0, width: _fill_int8(w, words, sc, zs, group, n0, width))
    elif few:
        status = fn(xs.data_ptr(), words.data_ptr(), sc.data_ptr(), z_ptr, _INT4_ZERO,
                    out.data_ptr(), M, K, N, group, threads)
    else:
        status = _chunked_matmul(xs, out, lambda w, n0, width: fn(
            words.data_ptr(), sc.data_ptr(), z_ptr, _INT4_ZERO, w.data_ptr(), K, N, group, n0, width, threads))
    if status != 0:  # arguments the C side refuses (check_args leaves none): the reference
        return _wna16.wna16_gemm_ref(x, qweight, scales, zeros, perm, weight_type, out_dtype, bias)
    if mins is not None:
        out -= xs.view(M, mins.shape[0], K // mins.shape[0]).sum(dim=2) @ mins
    if bias is not None:
        out = out + bias.float().reshape(1, -1)
    return out.to(out_dtype)


def _chunked_matmul(xs: torch.Tensor, out: torch.Tensor, fill) -> int:
    """`out = xs @ W` with the float32 weight `W [K, N]` made a column chunk at a time into one reused buffer by
    `fill(w, n0, width)` (the chunk `w [K, width]` of columns n0..; its status, 0 for done); the first nonzero status,
    else 0."""
    K, N = xs.shape[1], out.shape[1]
    buffer = torch.empty(K * min(N, CHUNK_COLUMNS), dtype=torch.float32)
    for n0 in range(0, N, CHUNK_COLUMNS):
        width = min(CHUNK_COLUMNS, N - n0)
        w = buffer[:K * width].view(K, width)
        status = fill(w, n0, width)
        if status != 0:
            return status
        out[:, n0:n0 + width] = xs @ w
    return 0


def _fill_int8(w: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
               n0: int, width: int) -> int:
    """Columns n0.. of `s * (v - z)` for int8 values `[K, N]` into the chunk `w [K, width]` (torch ops)."""
    K = values.shape[0]
    grouped = w.view(K // group, group, width)
    grouped.copy_(values[:, n0:n0 + width].view(K // group, group, width))
    if zeros is not None:
        grouped.sub_(zeros[:, None, n0:n0 + width])
    grouped.mul_(scales[:, None, n0:n0 + width])
    return 0
