"""`kestrel quantize --scheme w4a16 | w8a16`: RTN, AWQ-style scaling and GPTQ, written as compressed-tensors
`pack-quantized`.

Oracles:
- the quantizers' objective in float64 from the activations themselves (not from the Hessian the quantizers
  use): GPTQ's layer output error ||X W^T - X Q^T|| below RTN's, AWQ's activation-weighted error below RTN's, on
  the calibration activations and on held-out ones from the same distribution;
- llm-compressor 0.14 itself: its W4A16 recipe (round to nearest, min-max groups) writes the very codes and
  scales kestrel's RTN writes for the same float model;
- compressed-tensors / transformers loading kestrel's checkpoints: their decompressed weights equal the weights
  kestrel's loader runs (its kernel's dequantization), and kestrel's logits match that transformers model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_hf_parity import assert_rel_close, hf_logits, random_prompts

from kestrel import ops
from kestrel.config import ConfigError, ModelConfig
from kestrel.entrypoints.cli import main
from kestrel.loader import load_model
from kestrel.loader.hf_config import load_hf_config
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.layers.linear import LinearBase
from kestrel.model.registry import model_skeleton
from kestrel.quant import WNA16LinearMethod
from kestrel.quant.awq_search import search_scales
from kestrel.quant.calibrate import QuantizeOptions, quantize_checkpoint
from kestrel.quant.gptq_solver import gptq
from kestrel.quant.int_weights import IntGrid, rtn
from kestrel.quant.weight_only import layer_groups

transformers = pytest.importorskip("transformers")
compressed_tensors = pytest.importorskip("compressed_tensors")

PROMPTS = random_prompts(1000, [7, 30, 13], seed=4)


# ------------------------------------------------------------------------------- the algorithms, float64 oracle


def activations(tokens: int, K: int, seed: int, outliers: bool = False) -> torch.Tensor:
    """Correlated inputs (a random mixing of fewer latent factors, uneven channel magnitudes), as a layer sees
    them; with `outliers`, a few channels 20x larger, as LLM activations have."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(K // 2, K, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    x = torch.randn(tokens, K // 2, generator=g, dtype=torch.float64) @ mixing
    x = x * torch.linspace(0.2, 2.0, K, dtype=torch.float64)
    if outliers:
        x[:, [3, 17, 40]] *= 20.0
    return x + 0.1 * torch.randn(tokens, K, generator=g, dtype=torch.float64)


def output_error(x: torch.Tensor, w: torch.Tensor, dequantized: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(x @ w.double().T - x @ dequantized.double().T))


WEIGHT = torch.randn(96, 128, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("group, symmetric, act_order, bits", [
    (32, True, True, 4), (32, True, False, 4), (64, False, True, 4), (-1, True, False, 4), (32, False, False, 8)])
def test_gptq_output_error_is_below_rtn(group, symmetric, act_order, bits):
    x, held_out = activations(2048, 128, seed=2), activations(2048, 128, seed=3)
    grid = IntGrid(bits, group, symmetric)
    ours = gptq(WEIGHT, (x.T @ x).float(), grid, act_order=act_order)
    plain = rtn(WEIGHT, grid)
    # Codes on the grid, one scale (and zero point) per group.
    assert ours.codes.dtype == torch.int8 and int(ours.codes.min()) >= grid.qmin and int(ours.codes.max()) <= grid.qmax
    assert ours.scale.shape == (96, 128 // grid.group(128))
    for data, margin in ((x, 0.8), (held_out, 0.85)):
        assert output_error(data, WEIGHT, ours.dequantized()) < margin * output_error(data, WEIGHT,
                                                                                      plain.dequantized())


def test_awq_scales_lower_the_activation_weighted_error():
    x, held_out = activations(2048, 128, seed=4, outliers=True), activations(2048, 128, seed=5, outliers=True)
    grid = IntGrid(4, 32, True)
    weights = [WEIGHT, torch.randn(48, 128, generator=torch.Generator().manual_seed(6))]
    s, alpha = search_scales(weights, [grid, grid], (x.T @ x).float(), x.abs().mean(0).float())
    assert alpha > 0 and s.shape == (128,)
    assert float(s[[3, 17, 40]].min()) > float(s.median())  # the outlier channels get the largest scales
    for data in (x, held_out):
        for w in weights:
            # The layer computes (x / s) Q(W s)^T: W's effective weight is Q(W s) / s.
            scaled = rtn(w * s, grid).dequantized() / s
            assert output_error(data, w, scaled) < 0.9 * output_error(data, w, rtn(w, grid).dequantized())


def test_clipped_ranges_do_not_raise_the_output_error():
    x = activations(2048, 128, seed=7)
    grid = IntGrid(4, 32, False)
    clipped = rtn(WEIGHT, grid, (x.T @ x).float())
    assert output_error(x, WEIGHT, clipped.dequantized()) <= output_error(x, WEIGHT, rtn(WEIGHT, grid).dequantized())


def test_layer_groups_follow_the_decoder_layers():
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.up_proj",
             "model.layers.10.mlp.up_proj", "head"]
    assert layer_groups(names) == [names[:2], [names[2]], [names[3]], ["head"]]


# ------------------------------------------------------------------------------------- checkpoints, both ways


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("base")
    write_tiny_checkpoint(str(path), arch="llama", seed=6, tie_word_embeddings=False)
    return path


def samples(n: int = 8, length: int = 32) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 1000, (length,), generator=g).tolist() for _ in range(n)]


def decompressed_model(path: Path) -> torch.nn.Module:
    """transformers with compressed-tensors, the checkpoint's weights decompressed to dense ones."""
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager",
        quantization_config=CompressedTensorsConfig(dequantize=True)).eval()


def kestrel_weights(path: Path) -> dict[str, torch.Tensor]:
    """The weight each of kestrel's weight-only layers runs, per checkpoint module (its kernel's dequantization)."""
    model = load_model(ModelConfig(model=str(path), dtype="float32"))
    weights = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        assert isinstance(module.quant_method, WNA16LinearMethod), name
        dense = ops.dequantize_wna16(module.wna16_qweight, module.wna16_scales, module.wna16_zeros,
                                     module.wna16_perm, module.quant_method.weight_type)  # [N, K]
        prefix, leaf = name.rsplit(".", 1)
        parts = model.packed_modules_mapping.get(leaf, (leaf,))
        sizes = module.output_partition_sizes if len(parts) > 1 else [dense.shape[0]]
        for part, chunk in zip(parts, dense.split(sizes), strict=True):
            weights[f"{prefix}.{part}"] = chunk
    return weights


CASES = {  # name -> QuantizeOptions settings (scheme first)
    "w4a16-rtn-g32": dict(scheme="w4a16", group_size=32),
    "w4a16-awq-g32": dict(scheme="w4a16", group_size=32, algorithm="awq"),
    "w4a16-gptq-g32-asym": dict(scheme="w4a16", group_size=32, algorithm="gptq", symmetric=False),
    "w8a16-gptq-channel-no-act-order": dict(scheme="w8a16", group_size=-1, algorithm="gptq", act_order=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_written_checkpoints_load_in_compressed_tensors_and_kestrel(base, tmp_path, name):
    settings = dict(CASES[name])
    out = tmp_path / name
    options = QuantizeOptions(settings.pop("scheme"), **settings)
    summary = quantize_checkpoint(base, out, options, samples() if options.needs_calibration else None,
                                  model=model_skeleton(load_hf_config(base)))
    assert summary["linear_layers"] == 7 * 2 and summary["algorithm"] == options.weight_only.algorithm
    if options.weight_only.algorithm == "awq":  # scales folded into both norms and into up_proj (before down_proj)
        assert {name.split(".", 3)[-1] for name in summary["awq_alpha"]} == {
            "input_layernorm", "post_attention_layernorm", "mlp.up_proj"}
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(config)  # compressed-tensors' own parser accepts it
    assert parsed.format == "pack-quantized" and parsed.config_groups["group_0"].input_activations is None
    reference = decompressed_model(out)
    ours = kestrel_weights(out)
    assert len(ours) == 7 * 2
    theirs = dict(reference.named_modules())
    for module, weight in ours.items():
        assert torch.equal(weight, theirs[module].weight.detach().float()), module
    for prompt, logits in zip(PROMPTS, kestrel_logits(out), strict=True):
        assert_rel_close(logits, hf_logits(reference, prompt))


def kestrel_logits(path: Path) -> list[torch.Tensor]:
    from test_hf_parity import PagedBatch

    model = load_model(ModelConfig(model=str(path), dtype="float32"))
    return PagedBatch(model, len(PROMPTS)).step(PROMPTS, [(0, len(p)) for p in PROMPTS])


def test_rtn_writes_what_llm_compressor_writes(base, tmp_path):
    """The same float model through llm-compressor's W4A16 recipe (round to nearest on min-max groups of 32)."""
    llmcompressor = pytest.importorskip("llmcompressor")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True)
    recipe = QuantizationModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                                  ignore=["lm_head"])
    llmcompressor.oneshot(model=model, recipe=recipe)
    model.save_pretrained(str(tmp_path / "theirs"), save_compressed=True)
    quantize_checkpoint(base, tmp_path / "ours", QuantizeOptions("w4a16", group_size=32), None,
                        model=model_skeleton(load_hf_config(base)))
    theirs = load_file(str(tmp_path / "theirs" / "model.safetensors"))
    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    packed = [k for k in theirs if k.endswith(".weight_packed")]
    assert len(packed) == 7 * 2 and set(packed) == {k for k in ours if k.endswith(".weight_packed")}
    for key in packed:
        module = key.removesuffix(".weight_packed")
        assert torch.equal(ours[key], theirs[key]), key
        assert torch.equal(ours[module + ".weight_scale"], theirs[module + ".weight_scale"].float()), module


def test_cli_quantizes_w4a16_with_gptq(base, tmp_path, capsys):
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"input_ids": s}) for s in samples(4, 40)))
    out = tmp_path / "cli"
    assert main(["quantize", str(base), str(out), "--scheme", "w4a16", "--algorithm", "gptq", "--group-size", "32",
                 "--no-symmetric", "--dampening", "0.05", "--calibration", str(calib), "--num-samples", "4",
                 "--seq-len", "32", "--kv-cache", "fp8"]) == 0
    assert "compressed-tensors w4a16" in capsys.readouterr().out
    weights = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "weights"]
    assert (weights["group_size"], weights["symmetric"], weights["actorder"]) == (32, False, "static")
    from kestrel import LLM, SamplingParams

    llm = LLM(str(out), dtype="float32", max_model_len=128, kv_cache_dtype="fp8")
    result = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(result[0].outputs[0].token_ids) == 4
    assert llm.runner.kv_scales[0] != (1.0, 1.0)  # the calibrated KV scales beside the weight-only layers


@pytest.mark.parametrize("settings, message", [
    (dict(scheme="fp8-static", group_size=128), "group_size=128 with scheme='fp8-static'"),
    (dict(scheme="w8a8-int8", algorithm="gptq"), "algorithm='gptq' with scheme='w8a8-int8'"),
    (dict(scheme="w4a16", smoothquant=0.5), "smoothquant=0.5 with scheme='w4a16'"),
    (dict(scheme="w4a16", weight_strategy="tensor"), "weight_strategy='tensor' with scheme='w4a16'"),
    (dict(scheme="w4a16", algorithm="awq", act_order=True), "act_order=True with algorithm='awq'"),
    (dict(scheme="w4a16", dampening=0.1), "dampening=0.1 with algorithm='rtn'"),
    (dict(scheme="w4a16", algorithm="gptq", dampening=0.0), "dampening=0.0"),
    (dict(scheme="w4a16", group_size=24), "group_size=24"),
    (dict(scheme="w4a16", algorithm="sparsegpt"), "algorithm='sparsegpt'"),
])
def test_weight_only_settings_are_checked(settings, message):
    settings = dict(settings)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        QuantizeOptions(settings.pop("scheme"), **settings)


def test_groups_that_do_not_divide_a_layer_and_missing_samples_are_errors(base, tmp_path):
    skeleton = model_skeleton(load_hf_config(base))
    with pytest.raises(ConfigError, match=r"group_size=48 for 'model.layers.0.self_attn.q_proj'"):
        quantize_checkpoint(base, tmp_path / "a", QuantizeOptions("w4a16", group_size=48), None, model=skeleton)
    with pytest.raises(ConfigError, match="algorithm='awq'.*needs calibration samples"):
        quantize_checkpoint(base, tmp_path / "b", QuantizeOptions("w4a16", algorithm="awq"), None, model=skeleton)
