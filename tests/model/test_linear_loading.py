"""The loading contract between linear layers and quant methods, and the quant registry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kestrel.config import ConfigError, QuantConfig
from kestrel.model.layers.linear import (
    MergedColumnLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowLinear,
    process_linear_layers_after_loading,
)
from kestrel.model.layers.weights import WeightShapeError
from kestrel.quant import QUANT_METHODS, UnquantizedLinearMethod, get_quant_method
from kestrel.quant.base import QuantMethod


class PerShardScaleMethod(QuantMethod):
    """A toy method shaped like a per-tensor W8A8 one: a weight plus one scale per merged shard."""

    def __init__(self) -> None:
        self.processed = False

    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size, dtype=params_dtype),
                              requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        scale = nn.Parameter(torch.zeros(max(len(output_partition_sizes), 1)), requires_grad=False)
        scale.per_shard = True
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", scale)

    def process_after_loading(self, layer) -> None:
        self.processed = True

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


def test_qkv_shards_land_in_place_and_match_separate_projections() -> None:
    hidden, head, heads, kv_heads = 8, 2, 4, 2
    layer = QKVParallelLinear(hidden, head, heads, kv_heads, bias=True)
    parts = {sid: (torch.randn(n * head, hidden), torch.randn(n * head))
             for sid, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    for sid, (w, b) in parts.items():
        layer.weight.weight_loader(layer.weight, w, sid)
        layer.bias.weight_loader(layer.bias, b, sid)
    x = torch.randn(3, hidden)
    for out, (w, b) in zip(layer.split_qkv(layer(x)), parts.values()):
        torch.testing.assert_close(out, F.linear(x, w, b))


def test_gate_up_shards_and_shape_error() -> None:
    layer = MergedColumnLinear(4, [6, 6])
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    torch.testing.assert_close(layer.weight, torch.cat([gate, up]))
    with pytest.raises(WeightShapeError, match=r"\(5, 4\).*\(6, 4\)"):
        layer.weight.weight_loader(layer.weight, torch.randn(5, 4), 0)
    with pytest.raises(ValueError, match="unknown shard id 2"):
        layer.weight.weight_loader(layer.weight, gate, 2)


def test_quant_method_parameters_get_the_layer_loader_and_post_processing() -> None:
    method = PerShardScaleMethod()
    model = nn.Sequential(QKVParallelLinear(8, 2, 4, 2, quant_method=method))
    layer = model[0]
    assert layer.weight_scale.weight_loader == layer.weight_loader
    for i, sid in enumerate("qkv"):
        layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor([0.5 + i]), sid)
    torch.testing.assert_close(layer.weight_scale, torch.tensor([0.5, 1.5, 2.5]))
    process_linear_layers_after_loading(model)
    assert method.processed


def test_tensor_parallel_loaders_take_this_ranks_slice() -> None:
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    column = MergedColumnLinear(6, [4, 4], tp_size=2, tp_rank=1)
    column.weight.weight_loader(column.weight, full[:4], 0)
    column.weight.weight_loader(column.weight, full[4:], 1)
    torch.testing.assert_close(column.weight, torch.cat([full[2:4], full[6:8]]))
    row = RowLinear(6, 8, bias=True, tp_size=2, tp_rank=1)
    row.weight.weight_loader(row.weight, full)
    row.bias.weight_loader(row.bias, torch.ones(8))
    torch.testing.assert_close(row.weight, full[:, 3:])
    torch.testing.assert_close(row.bias, torch.ones(8))


def test_replicated_linear_is_plain() -> None:
    layer = ReplicatedLinear(4, 3)
    w = torch.randn(3, 4)
    layer.weight.weight_loader(layer.weight, w)
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), x @ w.T)


def test_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(get_quant_method(None, "x"), UnquantizedLinearMethod)
    assert isinstance(get_quant_method(QuantConfig(), "x"), UnquantizedLinearMethod)
    monkeypatch.delitem(QUANT_METHODS, "int8", raising=False)
    with pytest.raises(ConfigError, match="quantization='int8'.*registered"):
        get_quant_method(QuantConfig(method="int8"), "model.layers.0.mlp.down_proj")
    monkeypatch.setitem(QUANT_METHODS, "int8", lambda cfg: PerShardScaleMethod())
    assert isinstance(get_quant_method(QuantConfig(method="int8"), "x"), PerShardScaleMethod)
