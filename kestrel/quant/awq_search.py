"""AWQ-style activation-aware scaling for the weight-only quantizer: per input channel j, a scale s_j that
multiplies the weights' column j before quantization and divides the input, folded into the module that produces
that input so the float model computes the same function.

The scale is s = a^alpha / sqrt(max(a^alpha) * min(a^alpha)), a_j the mean |x_j| over the calibration inputs; alpha
is chosen on a grid of `GRID` points in [0, 1) to minimize the output error of every linear layer reading the input,
sum over layers of ||X W^T - (X / s) Q(W s)^T||^2 = tr(D H D^T) with D = W - Q(W s) / s and H = X^T X (alpha 0 is
plain round-to-nearest, so the search never does worse on the calibration data).

Where s goes: a norm whose output feeds the layers directly (its weight divided by s, as SmoothQuant does; the
pairs are the ones the calibration forward observed), or a linear layer whose output rows feed them linearly (its
rows divided by s: up_proj before down_proj, v_proj before o_proj without grouped queries), found by
`foldable_linear_pairs`: scaling the producer's rows and the consumer's columns by inverse powers of two must leave
the model's logits unchanged. Layers with neither (o_proj under grouped-query attention) are quantized unscaled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from kestrel.quant.int_weights import IntGrid, rtn

GRID = 20


def weighted_error(weight: torch.Tensor, dequantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """||X W^T - X Wq^T||_F^2 given H = X^T X."""
    d = (weight - dequantized).to(hessian.dtype)
    return float(((d @ hessian) * d).sum())


def search_scales(weights: Sequence[torch.Tensor], grids: Sequence[IntGrid], hessian: torch.Tensor,
                  act_mean: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The scales `[K]` (and the alpha they came from) for the layers `weights` (each `[N_i, K]`) reading one
    input, whose calibration statistics are `hessian` and `act_mean`."""
    ws = [w.float() for w in weights]
    a = act_mean.float().clamp_min(1e-6)
    best: tuple[float, float, torch.Tensor] | None = None
    for step in range(GRID):
        alpha = step / GRID
        s = a.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        err = sum(weighted_error(w, rtn(w * s, grid).dequantized() / s, hessian) for w, grid in zip(ws, grids))
        if best is None or err < best[0]:
            best = (err, alpha, s)
    assert best is not None
    return best[2], best[1]


def foldable_linear_pairs(model: nn.Module, linears: Sequence[str], ids: torch.Tensor,
                          forward: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, str]:
    """producer linear -> consumer linear, for the pairs (same parent module, producer's outputs = consumer's
    inputs) where dividing the producer's output rows by s and multiplying the consumer's input columns by s leaves
    the logits of `forward(ids)` unchanged (tested with powers of two, which the float arithmetic scales exactly)."""
    modules = dict(model.named_modules())
    pairs: dict[str, str] = {}
    with torch.no_grad():
        reference = forward(ids)
        for producer in linears:
            for consumer in linears:
                p, c = modules[producer], modules[consumer]
                if (producer == consumer or producer.rpartition(".")[0] != consumer.rpartition(".")[0]
                        or p.weight.shape[0] != c.weight.shape[1] or producer in pairs):
                    continue
                factors = 2.0 ** (torch.arange(p.weight.shape[0], device=p.weight.device) % 3 - 1).to(p.weight.dtype)
                _fold(p, c, factors)
                try:
                    got = forward(ids)
                finally:
                    _fold(p, c, 1.0 / factors)
                if torch.allclose(got, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max())):
                    pairs[producer] = consumer
    return pairs


def _fold(producer: nn.Module, consumer: nn.Module, s: torch.Tensor) -> None:
    producer.weight.div_(s[:, None])
    if getattr(producer, "bias", None) is not None:
        producer.bias.div_(s)
    consumer.weight.mul_(s[None, :])
