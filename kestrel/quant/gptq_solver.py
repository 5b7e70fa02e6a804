"""GPTQ for one linear layer: quantize the weight columns one at a time and spread each column's rounding error over
the columns not yet quantized, so that ||X W^T - X Q^T|| stays small on the calibration inputs X.

With H = X^T X (any positive multiple of it: GPTQ's 2 X^T X / n changes nothing here) dampened by `damp` times its
mean diagonal, and U the upper Cholesky factor of H^-1, quantizing column i to q_i with error
e = (w_i - q_i) / U[i, i] is compensated optimally (for the quadratic error, the later columns free) by
W[:, j] -= e * U[i, j] for j > i. Columns are processed in blocks: inside a block the update is applied column by
column, the rest of the matrix gets the block's errors in one matrix product.

Groups: each group's scale and zero point are chosen from the (already error-compensated) weights when its first
column is reached, its range clipped where that lowers the group's own output error (`int_weights.group_params`;
min-max ranges cost this repository's small model about a point of perplexity). With `act_order`, columns are
processed by decreasing H[i, i] (the inputs with the most energy first, while most columns are still free to
absorb their error), and the groups stay contiguous runs of the original features with their grids chosen from the
original weights before the pass (compressed-tensors' `actorder: "static"`, GPTQ's static groups): the checkpoint
needs no g_idx and the kernel no permutation.
"""

from __future__ import annotations

import torch

from kestrel.config import ConfigError
from kestrel.quant.int_weights import IntGrid, QuantizedLinear, finish, group_params

BLOCK = 128


def gptq(weight: torch.Tensor, hessian: torch.Tensor, grid: IntGrid, damp: float = 0.01,
         act_order: bool = False, clip: bool = True) -> QuantizedLinear:
    """`weight [N, K]`, `hessian [K, K]` (sum of x x^T over the calibration inputs of this layer)."""
    W = weight.float().clone()
    N, K = W.shape
    g = grid.group(K)
    H = hessian.to(torch.float64).clone()
    if H.shape != (K, K):
        raise ValueError(f"gptq: Hessian {tuple(H.shape)} for a weight with {K} input features")
    dead = H.diagonal() == 0  # inputs never seen: their columns cannot matter, quantize them as zero
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    G = K // g
    scales = torch.zeros(N, G, dtype=W.dtype)
    zeros = None if grid.symmetric else torch.zeros(N, G, dtype=W.dtype)
    static = act_order or g == K
    if static:  # every group's grid from the weights before the pass, its range clipped by the output error
        scales, zeros = group_params(W, grid, H if clip else None)
    perm = torch.argsort(H.diagonal(), descending=True, stable=True) if act_order else torch.arange(K)
    W = W[:, perm]
    H = H[perm][:, perm]
    H.diagonal().add_(damp * float(H.diagonal().mean()))
    try:
        U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).to(W.dtype)
    except torch.linalg.LinAlgError:
        raise ConfigError(f"invalid dampening={damp}: the calibration Hessian is not positive definite after "
                          "dampening; raise it (e.g. 0.1) or calibrate on more samples") from None
    codes = torch.zeros(N, K, dtype=W.dtype)
    # Dynamic groups start at block boundaries or inside a block at multiples of g: a block holds whole groups.
    block = BLOCK if static else g * max(1, BLOCK // g)
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        W1 = W[:, b0:b1].clone()
        errors = torch.zeros_like(W1)
        U1 = U[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            group = int(perm[col]) // g
            if not static and col % g == 0:
                s, z = group_params(W1[:, i:i + g], grid, H[col:col + g, col:col + g] if clip else None)
                scales[:, group] = s[:, 0]
                if zeros is not None:
                    zeros[:, group] = z[:, 0]
            zero = None if zeros is None else zeros[:, group]
            w = W1[:, i]
            q = grid.quantize(w, scales[:, group], zero)
            codes[:, col] = q
            err = (w - grid.dequantize(q, scales[:, group], zero)) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            errors[:, i] = err
        W[:, b1:] -= errors @ U[b0:b1, b1:]
    codes = codes[:, torch.argsort(perm)]
    return finish(codes, scales, zeros, grid)
