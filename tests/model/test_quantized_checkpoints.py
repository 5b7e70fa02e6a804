"""W8A8 checkpoints written by llm-compressor (compressed-tensors format) and the `fp8` format load in kestrel: Llama
with every scheme, FP8-dynamic Qwen2, Qwen3, Gemma 2 (tied embeddings, soft caps) and Phi-3 (whose checkpoint
stores qkv_proj and gate_up_proj merged, so llm-compressor quantizes each as one module).

The oracle is the checkpoint's own fake-quantized forward: transformers with compressed-tensors, which
decompresses the weights and quantizes each linear layer's input as the scheme says. Per linear layer, kestrel
is fed the exact input the oracle's layer saw, so the outputs must agree to the GEMM's bf16 output rounding; end
to end, the logits must sit closer to the oracle than the float model does, and greedy tokens agree wherever
the oracle's top two are clearly apart. Dynamic INT8 scales differ by design (absmax / 127 here and in vLLM,
/ 127.5 in compressed-tensors): per layer the bound adds one input step, and end to end the oracle is the float
architecture with the checkpoint's tensors and inputs fake-quantized at / 127. Unsupported schemes and
contradicting flags are ConfigErrors that name them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf_parity import PagedBatch, random_prompts

from kestrel.config import ConfigError, EngineConfig, ModelConfig, QuantConfig
from kestrel.loader import load_model
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.layers.linear import LinearBase

transformers = pytest.importorskip("transformers")
llmcompressor = pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from datasets import Dataset  # noqa: E402
from llmcompressor import oneshot  # noqa: E402
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier  # noqa: E402
from llmcompressor.modifiers.smoothquant import SmoothQuantModifier  # noqa: E402


def _args(kind: str, strategy: str, dynamic: bool = False, symmetric: bool = True) -> QuantizationArgs:
    return QuantizationArgs(num_bits=8, type=kind, strategy=strategy, dynamic=dynamic, symmetric=symmetric)


SCHEMES = {
    "fp8-dynamic": "FP8_DYNAMIC",  # llm-compressor's preset: per-channel weights, per-token inputs
    "fp8-static": QuantizationScheme(targets=["Linear"], weights=_args("float", "tensor"),
                                     input_activations=_args("float", "tensor")),
    "int8-dynamic": "W8A8",  # per-channel INT8 weights, dynamic per-token symmetric inputs
    "int8-static-asym": QuantizationScheme(targets=["Linear"], weights=_args("int", "channel"),
                                           input_activations=_args("int", "tensor", symmetric=False)),
    # llm-compressor's W8A8 INT8 recipe: SmoothQuant folded into the norms, then GPTQ-rounded weights
    "int8-smoothquant-gptq": "smoothquant+gptq",
}
PROMPTS = random_prompts(1000, [5, 29, 12, 40], seed=3)


def quantize(base: Path, out: Path, scheme) -> Path:
    """llm-compressor's oneshot on a saved model, with a short random calibration set for static scales."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if scheme == "smoothquant+gptq":
        recipe = [SmoothQuantModifier(smoothing_strength=0.8),
                  GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])]
    elif isinstance(scheme, str):
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    else:
        recipe = QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 1000, (32,), generator=g).tolist() for _ in range(16)]
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 32 for _ in ids]})
    oneshot(model=model, recipe=recipe, dataset=data, num_calibration_samples=16, max_seq_length=32)
    model.save_pretrained(str(out), save_compressed=True)
    return out


# arch -> config.json entries over `kestrel model-init`'s tiny config of it
BASES: dict[str, dict] = {
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": False},
    "qwen3": {},  # q/k norms per head
    # Tied embeddings, sandwich norms, alternating windows, and soft caps small enough to bite at this weight
    # scale (each moves the logits by 12-18%)
    "gemma2": {"attn_logit_softcapping": 0.5, "final_logit_softcapping": 1.0, "query_pre_attn_scalar": 1},
    "phi3": {},  # q/k/v and gate/up stored merged: llm-compressor quantizes qkv_proj and gate_up_proj whole
}
# Every scheme on Llama; FP8-dynamic (as the published Qwen3 FP8 checkpoints) on the other families, and Phi-3's
# merged modules with one per-tensor weight and input scale each.
CASES = [("llama", name) for name in SCHEMES] + [(arch, "fp8-dynamic") for arch in ("qwen2", "qwen3", "gemma2", "phi3")]
CASES.append(("phi3", "fp8-static"))


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory) -> dict[str, Path]:
    dirs = {}
    for arch, overrides in BASES.items():
        path = tmp_path_factory.mktemp(f"base-{arch}")
        write_tiny_checkpoint(str(path), arch=arch, seed=4, **overrides)
        dirs[arch] = path
    return dirs


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def checkpoint(request, base_dirs, tmp_path_factory) -> tuple[Path, Path]:
    arch, name = request.param
    out = quantize(base_dirs[arch], tmp_path_factory.mktemp(f"{arch}-{name}"), SCHEMES[name])
    return base_dirs[arch], out


def oracle(path: Path) -> torch.nn.Module:
    # Eager attention: the one implementation with Gemma 2's attention soft cap.
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def kestrel_logits(path: Path) -> list[torch.Tensor]:
    model = load_model(ModelConfig(model=str(path), dtype="float32"))
    return PagedBatch(model, len(PROMPTS)).step(PROMPTS, [(0, len(p)) for p in PROMPTS])


def assert_layers_match_fake_quantized_forward(path: Path, prompt: list[int]) -> None:
    """Every kestrel linear layer, fed the input the oracle's layer saw, gives the oracle's output to rounding."""
    hf = oracle(path)
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, (args[0], out)))
             for name, module in hf.named_modules() if isinstance(module, torch.nn.Linear) and name != "lm_head"]
    with torch.no_grad():
        hf(torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    ours = load_model(ModelConfig(model=str(path), dtype="float32"))
    # kestrel's merged layer -> the checkpoint modules it stacks (none for Phi-3, whose checkpoint stores them merged)
    merged = ours.packed_modules_mapping
    checked = 0
    for name, module in ours.named_modules():
        if not isinstance(module, LinearBase):
            continue
        prefix, leaf = name.rsplit(".", 1)
        parts = [f"{prefix}.{p}" for p in merged.get(leaf, (leaf,))]
        x = seen[parts[0]][0][0]
        ref = torch.cat([seen[p][1][0] for p in parts], dim=-1)
        with torch.no_grad():
            got = module(x)
        # The W8A8 GEMM rounds its output to bf16 once: 2^-8 relative to each output row's largest value.
        bound = 2.0**-8 * ref.abs().amax(dim=-1, keepdim=True) + 1e-6
        weight = torch.cat([hf.get_submodule(p).weight.float() for p in parts])
        if dynamic_int8(path):
            # Dynamic symmetric INT8 scales are absmax / 127 here (as in vLLM's kernels) and absmax / 127.5 in
            # compressed-tensors' fake quantization, so an input element may round one step apart:
            # |dy[m, n]| <= step[m] * sum_k |W[n, k]|, with step[m] = absmax(x[m]) / 127.
            bound = bound + (x.abs().amax(-1, keepdim=True) / 127) * weight.abs().sum(1)[None, :]
        elif static_int8(path):
            # The same static scale on both sides, but kestrel multiplies by its fp32 reciprocal where
            # compressed-tensors divides: an element within float error of a rounding boundary (x / s = j + 0.5)
            # may round one step apart, and only such elements.
            s = hf.get_submodule(parts[0]).input_scale.float().reshape(())
            v = x / s
            near_tie = ((v - v.floor() - 0.5).abs() < 1e-4).float()
            bound = bound + s * near_tie @ weight.abs().T
        assert bool(((got - ref).abs() <= bound).all()), f"{name}: max error {(got - ref).abs().max():.3e}"
        checked += 1
    assert checked == 4 * hf.config.num_hidden_layers


def test_every_linear_layer_matches_the_checkpoints_fake_quantized_forward(checkpoint):
    assert_layers_match_fake_quantized_forward(checkpoint[1], PROMPTS[3])


def per_token_127_oracle(base: Path, path: Path) -> torch.nn.Module:
    """For dynamic INT8 checkpoints: the float architecture (transformers) with the checkpoint's tensors, its
    linear weights dequantized, and each linear input quantized per token at absmax / 127 (kestrel's and vLLM's
    dynamic INT8), where compressed-tensors' fake quantization uses 127.5."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    tensors = load_file(str(path / "model.safetensors"))
    state = {}
    for name, tensor in tensors.items():
        if name.endswith(("_scale", "_zero_point")):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".weight_scale")
        state[name] = tensor.float() * scale.float().reshape(-1, 1) if scale is not None else tensor.float()
    model.load_state_dict(state, strict=False)

    def fake_quant(_m, args):
        step = (args[0].abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)
        return ((args[0] / step).round().clamp(-127, 127) * step,)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(fake_quant)
    return model


def _scheme(path: Path) -> dict:
    """The checkpoint's one quantization group (weights and input_activations)."""
    return json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]


def dynamic_int8(path: Path) -> bool:
    group = _scheme(path)
    return group["weights"]["type"] == "int" and group["input_activations"]["dynamic"]


def static_int8(path: Path) -> bool:
    inputs = _scheme(path)["input_activations"]
    return inputs["type"] == "int" and not inputs["dynamic"]


def test_logits_and_greedy_tokens_follow_the_checkpoint(checkpoint):
    base, path = checkpoint
    hf = per_token_127_oracle(base, path) if dynamic_int8(path) else oracle(path)
    float_model = oracle(base)
    for prompt, got in zip(PROMPTS, kestrel_logits(path), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
            full = float_model(torch.tensor([prompt])).logits[0]
        quant_effect = float((ref - full).norm() / full.norm())
        error = float((got - ref).norm() / ref.norm())
        # Each layer matches to rounding (above); through the layers, a rounding difference moves an 8-bit input
        # by a whole step now and then, so end to end kestrel need only be closer to the checkpoint than the
        # float model is.
        assert error < quant_effect, f"logits {error:.4f} from the checkpoint, quantization moved {quant_effect:.4f}"
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 4 * error * ref.abs().amax()
        assert bool((got.argmax(-1) == ref.argmax(-1))[clear].all()), "greedy tokens differ where the oracle is clear"


def test_fp8_format_loads_like_its_compressed_tensors_twin(base_dirs, tmp_path):
    """`quant_method: "fp8"` with static activations: per-tensor weights and input scales, vLLM's FP8 format."""
    ct = quantize(base_dirs["llama"], tmp_path / "ct", SCHEMES["fp8-static"])
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    config = json.loads((ct / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static",
                                     "ignored_layers": ["lm_head"]}
    (fp8 / "config.json").write_text(json.dumps(config))
    save_file(load_file(str(ct / "model.safetensors")), str(fp8 / "model.safetensors"))
    ours = kestrel_logits(fp8)
    twin = kestrel_logits(ct)
    for a, b in zip(ours, twin, strict=True):
        assert torch.equal(a, b)


def write_config(path: Path, quantization_config: dict) -> Path:
    write_tiny_checkpoint(str(path), arch="llama", seed=1)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("quantization_config, message", [
    ({"quant_method": "awq", "bits": 4, "version": "gemv", "group_size": 32, "zero_point": True}, "version"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "weight_block_size"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 3, "type": "int", "strategy": "group", "group_size": 32}}}},
     "num_bits"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                           "block_structure": [128, 128]},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
     "static input scales with block weights"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 32},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
     "strategy='group'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
     "quantizes 'lm_head'"),  # no ignore list: the LM head would be quantized
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"], "config_groups": {
        "group_0": {"targets": ["re:.*q_proj"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
     "different schemes"),  # q quantized, k and v not: one qkv GEMM cannot mix them
])
def test_unsupported_checkpoints_fail_at_start_up_naming_the_scheme(tmp_path, quantization_config, message):
    path = write_config(tmp_path / "m", quantization_config)
    with pytest.raises(ConfigError, match=message):
        load_model(ModelConfig(model=str(path), dtype="float32"))


def test_flags_that_contradict_the_checkpoint_are_errors(checkpoint):
    _, path = checkpoint
    with pytest.raises(ConfigError, match="quantization='int8'.*compressed-tensors"):
        load_model(ModelConfig(model=str(path), dtype="float32"), QuantConfig(method="int8"))
    with pytest.raises(ConfigError, match="activation_scheme='static'"):
        load_model(ModelConfig(model=str(path), dtype="float32"),
                   QuantConfig(method="compressed-tensors", activation_scheme="static"))
    # naming the checkpoint's own method is accepted
    load_model(ModelConfig(model=str(path), dtype="float32"), QuantConfig(method="compressed-tensors"))
    with pytest.raises(ConfigError, match="checkpoint has no quantization_config"):
        EngineConfig.from_kwargs(str(write_tiny_checkpoint_dir(path.parent / "plain")),
                                 quantization="compressed-tensors")


def write_tiny_checkpoint_dir(path: Path) -> Path:
    write_tiny_checkpoint(str(path), arch="llama", seed=1)
    return path
