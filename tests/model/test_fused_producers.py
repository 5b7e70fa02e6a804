"""Fused producers in the W8A8 model: RMSNorm(+residual)->quant feeds qkv_proj and gate_up_proj, SiLU-mul->quant
feeds down_proj. The fused and unfused paths compute the same quantization, so their logits must agree.

Bound: in float32 the fused references and the unfused path (RMSNorm module, F.silu, then the per-token
quantizer) differ only in the order of fp32 roundings (mean vs sum/n, rsqrt vs 1/sqrt, silu formula), about
1e-7 relative before quantization. An 8-bit code changes only when a value sits within that distance of a
rounding boundary, which for a tiny model's few thousand activations per layer is rare, and one changed code
moves its GEMM output by one quantization step at most. So the fused-vs-unfused difference must be far below the
quantization error itself (quantized vs unquantized logits); we allow 5% of it. Measured: exactly 0.0 for every
method on llama and qwen2 (float32, CPU), against quantization errors of 0.005 (int8) to 0.037 (fp8).
A wrong scale, a dropped zero point or a skipped residual add moves the logits by more than the quantization
error, so the bound still catches real bugs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kestrel import ops
from kestrel.config import ModelConfig, QuantConfig
from kestrel.loader import load_model
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.quant.w8a8 import W8A8LinearMethod

sys.path.insert(0, str(Path(__file__).parent))
from test_quantized import PROMPT_LENS, last_logits  # noqa: E402

CONFIGS = {
    "fp8": QuantConfig(method="fp8"),
    "int8-sym": QuantConfig(method="int8"),
    "int8-asym": QuantConfig(method="int8", symmetric_activations=False),
}
FRACTION_OF_QUANT_ERROR = 0.05


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory) -> tuple[Path, list[list[int]], torch.Tensor]:
    path = tmp_path_factory.mktemp(f"fused-{request.param}")
    write_tiny_checkpoint(path, arch=request.param, seed=1)
    reference = load_model(ModelConfig(model=str(path), dtype="float32"))
    assert not any(layer.fuse_quant_producers for layer in reference.model.layers)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, reference.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return path, prompts, last_logits(reference, prompts)


def set_fused(model: torch.nn.Module, fused: bool) -> None:
    for layer in model.model.layers:
        layer.fuse_quant_producers = fused


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_matches_unfused(tiny, name: str) -> None:
    path, prompts, reference = tiny
    model = load_model(ModelConfig(model=str(path), dtype="float32"), CONFIGS[name])
    assert all(layer.fuse_quant_producers for layer in model.model.layers)
    fused = last_logits(model, prompts)
    set_fused(model, False)
    unfused = last_logits(model, prompts)
    quant_error = (unfused - reference).abs().max().item()
    diff = (fused - unfused).abs().max().item()
    assert quant_error > 0
    assert diff <= FRACTION_OF_QUANT_ERROR * quant_error, f"fused vs unfused {diff} vs quantization error {quant_error}"
    assert torch.equal(fused.argmax(-1), unfused.argmax(-1))


def test_fused_path_uses_the_fused_ops(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per layer: two RMSNorm->quant, one SiLU-mul->quant, and no standalone activation quantization."""
    path, prompts, _ = tiny
    model = load_model(ModelConfig(model=str(path), dtype="float32"), CONFIGS["int8-asym"])
    calls = {"rms_norm_quant": 0, "act_mul_quant": 0, "quantize_input": 0}

    def counting(name: str, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(ops, "rms_norm_quant", counting("rms_norm_quant", ops.rms_norm_quant))
    monkeypatch.setattr(ops, "act_mul_quant", counting("act_mul_quant", ops.act_mul_quant))
    monkeypatch.setattr(W8A8LinearMethod, "quantize_input",
                        counting("quantize_input", W8A8LinearMethod.quantize_input))
    last_logits(model, prompts)
    num_layers = model.config.num_layers
    # o_proj still quantizes its own input (attention output has no fused producer yet).
    assert calls == {"rms_norm_quant": 2 * num_layers, "act_mul_quant": num_layers, "quantize_input": num_layers}
