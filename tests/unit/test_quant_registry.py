"""The quantization scheme registry: the built-in schemes register themselves, the plan picks a scheme by the
checkpoint's `quant_method` or the `quantization=` flag, unknown names are ConfigErrors listing the registered
ones, and a new scheme needs nothing but its class."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
from torch import nn

import kestrel.quant.schemes
from kestrel.config import QUANTIZATION_CHOICES, ConfigError, QuantConfig
from kestrel.quant import (
    KV_SCALE_NAMES,
    SCHEMES,
    QuantPlan,
    QuantScheme,
    UnquantizedLinearMethod,
    register_scheme,
    registered_schemes,
)
from kestrel.quant.schemes.compressed_tensors import CompressedTensorsScheme
from kestrel.quant.schemes.fp8 import Fp8Scheme
from kestrel.quant.unquantized import UnquantizedLinearMethod as Plain
from kestrel.quant.w8a8_fp8 import Fp8LinearMethod
from kestrel.quant.w8a8_int8 import Int8LinearMethod

FP8_DYNAMIC_CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                  "config_groups": {"group_0": {
                      "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}


@pytest.fixture
def registry():
    """SCHEMES as it was before the test, whatever the test registered."""
    saved = dict(SCHEMES)
    yield SCHEMES
    SCHEMES.clear()
    SCHEMES.update(saved)


def test_each_module_under_schemes_registers_a_scheme():
    modules = {f"kestrel.quant.schemes.{m.name}" for m in pkgutil.iter_modules(kestrel.quant.schemes.__path__)}
    registering = {cls.__module__ for cls in SCHEMES.values()}
    assert modules <= registering
    assert {"compressed-tensors", "fp8", "int8"} <= set(registered_schemes())
    # config's list of quantization= names has a scheme for each
    assert {name for name in QUANTIZATION_CHOICES if name} <= set(SCHEMES)


def test_the_checkpoint_chooses_its_scheme_by_quant_method():
    plan = QuantPlan.build(None, {"quantization_config": FP8_DYNAMIC_CT})
    assert isinstance(plan.scheme, CompressedTensorsScheme) and plan.checkpoint is plan.scheme
    method = plan.method_for("model.layers.0.self_attn.qkv_proj", ["model.layers.0.self_attn.q_proj",
                                                                   "model.layers.0.self_attn.k_proj",
                                                                   "model.layers.0.self_attn.v_proj"])
    assert isinstance(method, Fp8LinearMethod) and method.prequantized and not method.static
    with pytest.raises(ConfigError, match="quantizes 'lm_head'"):
        QuantPlan.build(None, {"quantization_config": {**FP8_DYNAMIC_CT, "ignore": []}}).check_unquantized("lm_head")
    fp8 = QuantPlan.build(None, {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})
    assert isinstance(fp8.scheme, Fp8Scheme) and fp8.scheme.prequantized
    assert fp8.method_for("x").weight_per_tensor and fp8.method_for("x").static


def test_the_flag_chooses_a_scheme_that_quantizes_at_load():
    plan = QuantPlan(QuantConfig(method="fp8"))
    assert isinstance(plan.scheme, Fp8Scheme) and not plan.scheme.prequantized and plan.checkpoint is None
    method = plan.method_for("model.layers.0.mlp.down_proj")
    assert isinstance(method, Fp8LinearMethod) and not method.prequantized and not method.defer_weight
    plan.check_unquantized("lm_head")  # nothing is saved quantized: nothing to refuse
    asym = QuantPlan(QuantConfig(method="int8", symmetric_activations=False)).method_for("x")
    assert isinstance(asym, Int8LinearMethod) and not asym.symmetric
    deferred = QuantPlan(QuantConfig(method="int8"), random_weights=True).method_for("x")
    assert deferred.defer_weight
    assert isinstance(QuantPlan().method_for("x"), UnquantizedLinearMethod)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "hqq"},
     r"quant_method='hqq'.*registered: \['awq', 'bitsandbytes', 'compressed-tensors', 'fp8', .*'gptq', 'int8'\]"),
    ({"quant_method": "int8"}, "no checkpoint format of that name"),
])
def test_unknown_checkpoint_schemes_are_config_errors(config, message):
    with pytest.raises(ConfigError, match=message):
        QuantPlan.build(None, {"quantization_config": config})


def test_a_checkpoint_format_is_no_flag():
    with pytest.raises(ConfigError, match="quantization='compressed-tensors'.*checkpoint format"):
        QuantPlan(QuantConfig(method="compressed-tensors"))


class HalfMethod(Plain):
    """A toy method: the weight loads as saved and is halved after loading."""

    def process_after_loading(self, layer):
        layer.weight.data.mul_(0.5)


def test_a_new_scheme_is_one_registered_class(registry):
    @register_scheme("toy-half")
    class ToyScheme(QuantScheme):
        loads_checkpoints = True
        prequantized = True

        def __init__(self, skip: tuple[str, ...]) -> None:
            self.skip = skip

        @classmethod
        def from_config(cls, config):
            return cls(tuple(config.get("skip", ())))

        def get_quant_method(self, kind, prefix, parts=()):
            return None if prefix in self.skip else HalfMethod()

    assert registry["toy-half"] is ToyScheme and ToyScheme.name == "toy-half"
    plan = QuantPlan.build(None, {"quantization_config": {"quant_method": "toy-half", "skip": ["b"]}})
    assert isinstance(plan.method_for("a"), HalfMethod)
    assert isinstance(plan.method_for("b"), UnquantizedLinearMethod)
    assert plan.kv_scale_names is KV_SCALE_NAMES and not plan.declares_kv_cache_scales
    with pytest.raises(ConfigError, match="quantization='int8'.*quant_method='toy-half'"):
        QuantPlan.build(QuantConfig(method="int8"), {"quantization_config": {"quant_method": "toy-half"}})
    # The layer loads and post-processes through the method, with no other code involved.
    from kestrel.model.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(2, 2, quant_method=plan.method_for("a"))
    layer.weight.weight_loader(layer.weight, torch.ones(2, 2))
    layer.process_after_loading()
    assert torch.equal(layer(torch.ones(1, 2)), torch.ones(1, 2))

    with pytest.raises(ValueError, match="registered twice"):
        register_scheme("toy-half")(type("Other", (ToyScheme,), {}))


def test_schemes_register_when_their_module_is_imported(registry):
    registry.pop("int8")
    importlib.reload(importlib.import_module("kestrel.quant.schemes.int8"))
    assert "int8" in registry


def test_kv_scale_names_are_relative_to_the_attention_module():
    names = KV_SCALE_NAMES.names("blocks.3.attention")
    assert names["k"] == ("blocks.3.attention.k_scale", "blocks.3.attention.attn.k_scale",
                          "blocks.3.attention.k_proj.output_scale")
    assert CompressedTensorsScheme.kv_scale_names.written("model.layers.0.self_attn") == (
        "model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale")
    assert KV_SCALE_NAMES.match("model.layers.7.self_attn.attn.v_scale") == ("model.layers.7.self_attn", "v")
    assert KV_SCALE_NAMES.match("model.layers.7.self_attn.v_proj.output_scale") == ("model.layers.7.self_attn", "v")
    assert KV_SCALE_NAMES.match("model.layers.7.self_attn.v_proj.weight_scale") is None
    assert "model.layers.0.self_attn.k_scale".endswith(KV_SCALE_NAMES.suffixes)
    assert QuantPlan.build(None, {"quantization_config": {**FP8_DYNAMIC_CT, "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": "tensor"}}}).declares_kv_cache_scales


def test_layer_kinds_a_scheme_does_not_know_are_config_errors():
    scheme = QuantPlan(QuantConfig(method="fp8")).scheme
    with pytest.raises(ConfigError, match="no method for moe layers"):
        scheme.get_quant_method("moe", "model.layers.0.mlp.experts")


def test_an_unquantized_method_needs_no_row_parallel_hooks():
    """The base hooks: no global input scale, the plain partial sum over the group."""

    class Group:
        def all_reduce(self, t):
            return t * 2

        def all_reduce_max(self, t):
            raise AssertionError("not needed")

    layer = nn.Module()
    method = Plain()
    layer.weight = nn.Parameter(torch.eye(2), requires_grad=False)
    assert not method.needs_global_input_scale(layer)
    out = method.apply_row_parallel(layer, torch.ones(1, 2), None, Group())
    assert torch.equal(out, torch.full((1, 2), 2.0))
    with pytest.raises(TypeError, match="model dtype"):
        method.quantize_input(layer, torch.ones(1, 2))
