"""Random weights quantized at load (load_format="dummy" with quantization="fp8"/"int8"): each layer's
high-precision weight is created, filled and quantized one layer at a time, with the values the model built
the plain way (every weight created first, then filled, then quantized) has."""

from __future__ import annotations

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


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_dummy_quantized_load_holds_one_float_layer_and_matches_the_plain_build(tmp_path, monkeypatch, method):
    hf = write_tiny_checkpoint(tmp_path, "llama", "tiny")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    quant = QuantConfig(method=method)

    # Oracle: the plain build, every bf16 weight created and filled before any is quantized.
    plain = LlamaForCausalLM(hf, torch.bfloat16, QuantPlan(quant))
    initialize_dummy_weights(plain, seed=0)
    plain.process_weights_after_loading()

    loading: list[torch.nn.Module] = []
    live_float_layers: list[int] = []
    original = LinearBase.process_after_loading

    def counting(self):  # at each quantization, how many linear layers hold a materialized 16-bit weight
        model = loading[-1]  # the one being loaded (the memory plan builds a meta-device one first)
        live_float_layers.append(sum(1 for m in model.modules() if isinstance(m, LinearBase)
                                     and not m.weight.is_meta and m.weight.dtype == torch.bfloat16))
        return original(self)

    real_init = LlamaForCausalLM.__init__

    def remember(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        loading.append(self)

    monkeypatch.setattr(LinearBase, "process_after_loading", counting)
    monkeypatch.setattr(LlamaForCausalLM, "__init__", remember)
    model = load_model(ModelConfig(model=str(tmp_path), dtype="bfloat16", load_format="dummy"), quant)

    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(live_float_layers) == len(linears)  # each layer quantized exactly once
    assert max(live_float_layers) == 1
    assert all(m.weight.element_size() == 1 for m in linears)
    ours, theirs = dict(model.named_parameters()), dict(plain.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert param.dtype == theirs[name].dtype, name
        assert torch.equal(param.view(torch.uint8) if param.element_size() == 1 else param,
                           theirs[name].view(torch.uint8) if param.element_size() == 1 else theirs[name]), name


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
