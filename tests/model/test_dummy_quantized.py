"""Random weights quantized at load (load_format="dummy" with quantization="fp8"/"int8"): each layer's
high-precision weight is created, filled and quantized one layer at a time, with the values the model built
the plain way (every weight created first, then filled, then quantized) has."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kestrel.config import ModelConfig, QuantConfig
from kestrel.loader import load_model
from kestrel.loader.dummy import initialize_dummy_weights
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.layers.linear import LinearBase
from kestrel.model.llama import LlamaForCausalLM
from kestrel.quant import QuantPlan


def load_counting_float_layers(tmp_path, monkeypatch, model_cls, layer_cls, float_weight, quant):
    """Load `model_cls` from the checkpoint in tmp_path with random weights quantized at load, counting at each
    `layer_cls` quantization how many such layers hold a materialized 16-bit weight (`float_weight(layer)`, or
    None where it has none). Returns (model, counts)."""
    loading: list[torch.nn.Module] = []
    live_float_layers: list[int] = []
    original = layer_cls.process_after_loading

    def counting(self):
        model = loading[-1]  # the one being loaded (the memory plan builds a meta-device one first)
        live_float_layers.append(sum(1 for m in model.modules() if isinstance(m, layer_cls)
                                     and not float_weight(m).is_meta and float_weight(m).dtype == torch.bfloat16))
        return original(self)

    real_init = model_cls.__init__

    def remember(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        loading.append(self)

    monkeypatch.setattr(layer_cls, "process_after_loading", counting)
    monkeypatch.setattr(model_cls, "__init__", remember)
    model = load_model(ModelConfig(model=str(tmp_path), dtype="bfloat16", load_format="dummy"), quant)
    monkeypatch.undo()
    return model, live_float_layers


def plain_build(model_cls, hf, quant):
    """The oracle: every bf16 weight created and filled before any is quantized."""
    plain = model_cls(hf, torch.bfloat16, QuantPlan(quant))
    initialize_dummy_weights(plain, seed=0)
    plain.process_weights_after_loading()
    return plain


def assert_same_parameters(model, plain):
    ours, theirs = dict(model.named_parameters()), dict(plain.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert param.dtype == theirs[name].dtype, name
        assert torch.equal(param.view(torch.uint8) if param.element_size() == 1 else param,
                           theirs[name].view(torch.uint8) if param.element_size() == 1 else theirs[name]), name


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_dummy_quantized_load_holds_one_float_layer_and_matches_the_plain_build(tmp_path, monkeypatch, method):
    hf = write_tiny_checkpoint(tmp_path, "llama", "tiny")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    quant = QuantConfig(method=method)
    plain = plain_build(LlamaForCausalLM, hf, quant)
    model, live_float_layers = load_counting_float_layers(tmp_path, monkeypatch, LlamaForCausalLM, LinearBase,
                                                          lambda m: m.weight, quant)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(live_float_layers) == len(linears)  # each layer quantized exactly once
    assert max(live_float_layers) == 1
    assert all(m.weight.element_size() == 1 for m in linears)
    assert_same_parameters(model, plain)


@pytest.mark.parametrize(("method", "gigabytes"), [(None, 141), ("fp8", 73)])
def test_out_of_memory_while_loading_is_a_config_error_with_the_per_rank_size(tmp_path, monkeypatch, method, gigabytes):
    from kestrel import loader
    from kestrel.bench.common import LLAMA3_70B
    from kestrel.config import ConfigError

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B))

    def out_of_memory(*_args, **_kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(loader, "initialize_dummy_weights", out_of_memory)
    quant = QuantConfig(method=method) if method else None
    with pytest.raises(ConfigError) as raised:
        load_model(ModelConfig(model=str(tmp_path), dtype="bfloat16", load_format="dummy"), quant, device="meta")
    # 80 x (8192 x 10240 + 8192 x 8192 + 3 x 8192 x 28672) projection weights (2 bytes in BF16, 1 in FP8) plus
    # two 128256 x 8192 BF16 tables (embedding, LM head).
    assert f"about {gigabytes} GB per rank at tp=1, pp=1" in str(raised.value)
    assert ("quantization='fp8'" in str(raised.value)) == (method is None)


def test_dummy_fp8_experts_quantize_one_layer_at_a_time_and_plan_as_fp8(tmp_path, monkeypatch):
    """A mixture's experts quantized at load are created, filled and quantized one layer at a time too (Mixtral-8x7B
    fits an 80 GB GPU only in FP8), with the plain build's values; the memory plan counts them as FP8, while loading
    as well."""
    from kestrel.loader.memory_plan import plan_memory
    from kestrel.model.layers.moe import FusedExperts
    from kestrel.model.registry import get_model_class

    hf = write_tiny_checkpoint(tmp_path, "mixtral", "tiny")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    quant = QuantConfig(method="fp8")
    model_cls = get_model_class("MixtralForCausalLM")
    plain = plain_build(model_cls, hf, quant)
    model, live_float_experts = load_counting_float_layers(tmp_path, monkeypatch, model_cls, FusedExperts,
                                                           lambda m: m.w13_weight, quant)
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert len(live_float_experts) == len(experts) == hf["num_hidden_layers"]
    assert max(live_float_experts) == 1
    assert_same_parameters(model, plain)

    loaded = (sum(p.numel() * p.element_size() for p in model.parameters())
              + sum(b.numel() * b.element_size() for b in model.buffers()))
    deferred = plan_memory(lambda: model_cls(hf, torch.bfloat16, dataclasses.replace(QuantPlan(quant),
                                                                                     random_weights=True)))
    # While loading: everything quantized so far plus the layer being filled, the largest one's BF16 experts.
    largest_float_layer = max(m.w13_weight.numel() * 2 + m.w2_weight.numel() * 2 for m in experts)
    assert deferred.weight_bytes == loaded and deferred.loading_bytes == loaded + largest_float_layer
    fp8_experts = sum(p.numel() * p.element_size() for m in experts for p in m.parameters(recurse=False))
    float_experts = sum(p.numel() * 2 for m in experts for p in (m.w13_weight, m.w2_weight))
    from_checkpoint = plan_memory(lambda: model_cls(hf, torch.bfloat16, QuantPlan(quant)))
    assert from_checkpoint.weight_bytes == loaded
    assert from_checkpoint.loading_bytes - loaded >= float_experts - fp8_experts
