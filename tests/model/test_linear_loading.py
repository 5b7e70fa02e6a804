"""The loading contract between linear layers and quant methods (merged shards, per-shard scales, tensor-parallel
slices of packed weights and group scales), and the plan's choice of method by scheme."""

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
from kestrel.quant import SCHEMES, QuantScheme, UnquantizedLinearMethod, get_quant_method
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


class PerShardScheme(QuantScheme):
    quantizes_at_load = True

    @classmethod
    def from_config(cls, config):
        return cls()

    def get_quant_method(self, kind, prefix, parts=()):
        return None if prefix == "lm_head" else PerShardScaleMethod()


def test_the_plan_takes_the_flags_scheme_from_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(get_quant_method(None, "x"), UnquantizedLinearMethod)
    assert isinstance(get_quant_method(QuantConfig(), "x"), UnquantizedLinearMethod)
    monkeypatch.delitem(SCHEMES, "int8")
    registered = r"registered: \['awq', 'bitsandbytes', 'compressed-tensors', 'fp8', .*'gptq'\]"
    with pytest.raises(ConfigError, match="quantization='int8'.*" + registered):
        get_quant_method(QuantConfig(method="int8"), "model.layers.0.mlp.down_proj")
    monkeypatch.setitem(SCHEMES, "int8", PerShardScheme)
    assert isinstance(get_quant_method(QuantConfig(method="int8"), "x"), PerShardScaleMethod)
    # A layer the scheme leaves alone (None) runs unquantized.
    assert isinstance(get_quant_method(QuantConfig(method="int8"), "lm_head"), UnquantizedLinearMethod)


# --------------------------------------------------------------------------- packed weights and group scales

PACK, GROUP = 8, 4  # eight 4-bit values per int32; one scale (and zero point) per 4 input features


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Unsigned 4-bit `values` -> int32, PACK consecutive values along `dim` per element (lowest bits first)."""
    v = values.movedim(dim, -1).to(torch.int64)
    v = v.reshape(*v.shape[:-1], -1, PACK)
    shifts = torch.arange(PACK, dtype=torch.int64) * 4
    packed = (v << shifts).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32).movedim(-1, dim)


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    p = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(PACK, dtype=torch.int64) * 4
    values = (p.unsqueeze(-1) >> shifts) & 0xF
    return values.reshape(*p.shape[:-1], -1).movedim(-1, dim)


class GroupInt4Method(QuantMethod):
    """A test-only weight-only 4-bit method: `qweight [N, K/8]` int32 packed along the input dim, `scales [N, K/g]`
    per group of input features and `qzeros [K/g, N/8]` packed along the output dim; W = (q - z) * s."""

    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype) -> None:
        n = sum(output_partition_sizes)
        qweight = nn.Parameter(torch.zeros(n, input_size // PACK, dtype=torch.int32), requires_grad=False)
        qweight.output_dim, qweight.input_dim, qweight.packed_dim, qweight.packed_factor = 0, 1, 1, PACK
        scales = nn.Parameter(torch.zeros(n, input_size // GROUP, dtype=params_dtype), requires_grad=False)
        scales.output_dim, scales.input_dim, scales.group_size = 0, 1, GROUP
        qzeros = nn.Parameter(torch.zeros(input_size // GROUP, n // PACK, dtype=torch.int32), requires_grad=False)
        qzeros.output_dim, qzeros.input_dim, qzeros.group_size = 1, 0, GROUP
        qzeros.packed_dim, qzeros.packed_factor = 1, PACK
        for name, param in (("qweight", qweight), ("scales", scales), ("qzeros", qzeros)):
            layer.register_parameter(name, param)

    def apply(self, layer, x, bias=None):
        return F.linear(x, dequantize(layer.qweight, layer.scales, layer.qzeros), bias)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor) -> torch.Tensor:
    q = unpack_int4(qweight, 1).float()
    zeros = unpack_int4(qzeros, 1).float().T.repeat_interleave(GROUP, dim=1)
    return (q - zeros) * scales.float().repeat_interleave(GROUP, dim=1)


def int4_checkpoint(n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    """One checkpoint module in the method's layout, and the float weight it stands for."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    zeros = torch.randint(0, 16, (k // GROUP, n), generator=g)
    scales = torch.rand(n, k // GROUP, generator=g) + 0.5
    tensors = {"qweight": pack_int4(q, 1), "scales": scales, "qzeros": pack_int4(zeros, 1)}
    tensors["dense"] = dequantize(tensors["qweight"], scales, tensors["qzeros"])
    return tensors


def load_module(layer, tensors: dict[str, torch.Tensor], shard_id=None) -> None:
    for name in ("qweight", "scales", "qzeros"):
        param = getattr(layer, name)
        param.weight_loader(param, tensors[name], shard_id)


def test_packing_helpers_round_trip() -> None:
    values = torch.randint(0, 16, (3, 16))
    assert torch.equal(unpack_int4(pack_int4(values, 1), 1), values)
    assert torch.equal(unpack_int4(pack_int4(values.T, 0), 0), values.T)


def test_row_parallel_ranks_take_their_packed_columns_and_groups() -> None:
    n, k = 16, 32  # per rank: 16 input features = 2 packed int32 columns = 4 groups
    module = int4_checkpoint(n, k, seed=0)
    x = torch.randn(3, k)
    partials = []
    for rank in range(2):
        layer = RowLinear(k, n, quant_method=GroupInt4Method(), tp_size=2, tp_rank=rank)
        assert layer.qweight.shape == (n, k // 2 // PACK) and layer.scales.shape == (n, k // 2 // GROUP)
        load_module(layer, module)
        features = slice(rank * k // 2, (rank + 1) * k // 2)
        torch.testing.assert_close(dequantize(layer.qweight, layer.scales, layer.qzeros), module["dense"][:, features])
        partials.append(layer.quant_method.apply(layer, x[:, features]))
    torch.testing.assert_close(partials[0] + partials[1], x @ module["dense"].T)


def test_column_parallel_merged_shards_place_packed_outputs() -> None:
    k, n = 16, 16  # gate and up of 16 outputs each: per rank 8 outputs = one packed qzeros column per shard
    gate, up = int4_checkpoint(n, k, seed=1), int4_checkpoint(n, k, seed=2)
    for rank in range(2):
        layer = MergedColumnLinear(k, [n, n], quant_method=GroupInt4Method(), tp_size=2, tp_rank=rank)
        assert layer.qzeros.shape == (k // GROUP, 2 * (n // 2) // PACK)
        load_module(layer, up, 1)
        load_module(layer, gate, 0)
        outputs = slice(rank * n // 2, (rank + 1) * n // 2)
        expected = torch.cat([gate["dense"][outputs], up["dense"][outputs]])
        torch.testing.assert_close(dequantize(layer.qweight, layer.scales, layer.qzeros), expected)


def test_qkv_kv_heads_replicated_over_ranks_keep_packed_outputs() -> None:
    hidden, head, heads, kv_heads = 16, 8, 4, 1  # tp 2 > kv heads: each rank holds the one kv head
    parts = {sid: int4_checkpoint(rows * head, hidden, seed=i)
             for i, (sid, rows) in enumerate((("q", heads), ("k", kv_heads), ("v", kv_heads)))}
    for rank in range(2):
        layer = QKVParallelLinear(hidden, head, heads, kv_heads, quant_method=GroupInt4Method(), tp_size=2,
                                  tp_rank=rank)
        for sid, module in parts.items():
            load_module(layer, module, sid)
        q_rows = slice(rank * heads // 2 * head, (rank + 1) * heads // 2 * head)
        expected = torch.cat([parts["q"]["dense"][q_rows], parts["k"]["dense"], parts["v"]["dense"]])
        torch.testing.assert_close(dequantize(layer.qweight, layer.scales, layer.qzeros), expected)


def test_a_rank_slice_that_cuts_a_group_is_an_error() -> None:
    method = GroupInt4Method()
    layer = RowLinear(32, 16, quant_method=method, tp_size=2, tp_rank=0)
    # A checkpoint of 24 input features (3 int32 columns): 12 per rank would split the second int32.
    with pytest.raises(ValueError, match="cut a packed element or a group of 8"):
        layer.qweight.weight_loader(layer.qweight, torch.zeros(16, 3, dtype=torch.int32))
