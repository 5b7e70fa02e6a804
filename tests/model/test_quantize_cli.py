"""`kestrel quantize`: SmoothQuant keeps the float model's function; the checkpoints it writes pass
compressed-tensors' own config parser, load in transformers + compressed-tensors, and kestrel's layers match
that fake-quantized forward as they do for llm-compressor's checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_quantized_checkpoints import PROMPTS, assert_layers_match_fake_quantized_forward

from kestrel.config import ConfigError
from kestrel.entrypoints.cli import main
from kestrel.loader.hf_config import load_hf_config
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.llama import LlamaForCausalLM
from kestrel.model.registry import model_skeleton
from kestrel.quant.calibrate import QuantizeOptions, QuantTargets, calibrate, quantize_checkpoint, smooth

transformers = pytest.importorskip("transformers")
compressed_tensors = pytest.importorskip("compressed_tensors")

LLAMA_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def test_llama_declares_its_packed_modules():
    """The quantizer reads the model's `packed_modules_mapping`."""
    assert LlamaForCausalLM.packed_modules_mapping == LLAMA_PACKED


def skeleton(path: Path):
    return model_skeleton(load_hf_config(path))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("base")
    write_tiny_checkpoint(str(path), arch="llama", seed=6, tie_word_embeddings=False)
    return path


def samples(n: int = 8, length: int = 32) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 1000, (length,), generator=g).tolist() for _ in range(n)]


def test_smoothquant_keeps_the_float_model(base, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float64).eval()
    weights = {k: v.double() for k, v in load_file(str(base / "model.safetensors")).items()}
    calibration = calibrate(model, samples(), torch.device("cpu"), QuantTargets.of_model(skeleton(base)))
    # the norms that feed linear layers, found in the forward (the final norm feeds the unquantized LM head)
    layers = [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    assert calibration.norm_feeds == {
        **{f"{p}.input_layernorm": tuple(f"{p}.self_attn.{x}_proj" for x in "qkv") for p in layers},
        **{f"{p}.post_attention_layernorm": (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj") for p in layers}}
    before = dict(calibration.input_absmax)
    smooth(weights, calibration, 0.5)
    ids = torch.tensor([PROMPTS[3]])
    with torch.no_grad():
        expected = model(ids).logits
        model.load_state_dict(weights, strict=False)
        got = model(ids).logits
    # smoothing computes in float32 (the checkpoint dtype): equal up to its rounding
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5
    # the smoothed activations' channel maxima shrink where they were largest
    name = "model.layers.0.self_attn.q_proj"
    assert float(calibration.input_absmax[name].max()) < float(before[name].max())


@pytest.mark.parametrize("scheme, smoothquant, strategy", [
    ("fp8-dynamic", None, "channel"), ("fp8-static", None, "channel"), ("fp8-static", None, "tensor"),
    ("w8a8-int8", 0.5, "channel"), ("w8a8-int8-static", 0.5, "channel")])
def test_written_checkpoints_load_and_match_their_fake_quantized_forward(base, tmp_path, scheme, smoothquant,
                                                                         strategy):
    out = tmp_path / "q"
    options = QuantizeOptions(scheme, smoothquant, kv_cache_fp8=scheme == "fp8-static", weight_strategy=strategy)
    summary = quantize_checkpoint(base, out, options, samples() if options.needs_calibration else None,
                                  model=skeleton(base))
    assert summary["linear_layers"] == 7 * 2
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(config)  # compressed-tensors' own parser accepts it
    assert parsed.config_groups["group_0"].input_activations.dynamic == ("static" not in scheme)
    assert_layers_match_fake_quantized_forward(out, PROMPTS[1])
    if options.kv_cache_fp8:
        tensors = load_file(str(out / "model.safetensors"))
        assert float(tensors["model.layers.0.self_attn.k_scale"]) > 0


def test_cli_writes_a_checkpoint_kestrel_serves(base, tmp_path, capsys):
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"input_ids": s}) for s in samples(4, 40)))
    out = tmp_path / "cli"
    assert main(["quantize", str(base), str(out), "--scheme", "fp8-static", "--calibration", str(calib),
                 "--num-samples", "4", "--seq-len", "32", "--kv-cache", "fp8"]) == 0
    assert "compressed-tensors fp8-static" in capsys.readouterr().out
    from kestrel import LLM, SamplingParams

    llm = LLM(str(out), dtype="float32", max_model_len=128, kv_cache_dtype="fp8")
    result = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(result[0].outputs[0].token_ids) == 4
    assert llm.runner.kv_scales[0] != (1.0, 1.0)  # the checkpoint's calibrated KV scales were bound


def test_token_id_calibration_needs_no_tokenizer(base, tmp_path, capsys):
    bare = tmp_path / "bare"  # random-weight benchmark models have no tokenizer
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((base / name).read_bytes())
    ids_file, text_file = tmp_path / "ids.jsonl", tmp_path / "calib.txt"
    ids_file.write_text("\n".join(json.dumps({"input_ids": s}) for s in samples(2, 40)))
    text_file.write_text("some calibration text " * 50)
    args = ["--scheme", "fp8-static", "--num-samples", "2", "--seq-len", "32", "--calibration"]
    assert main(["quantize", str(bare), str(tmp_path / "ok"), *args, str(ids_file)]) == 0
    assert main(["quantize", str(bare), str(tmp_path / "no"), *args, str(text_file)]) == 2
    assert "no tokenizer to encode calibration text" in capsys.readouterr().err


def test_bad_quantize_arguments_are_config_errors(base, tmp_path):
    with pytest.raises(ConfigError, match="scheme='w3a16'"):
        QuantizeOptions("w3a16")
    with pytest.raises(ConfigError, match="smoothquant=1.5"):
        QuantizeOptions("w8a8-int8", smoothquant=1.5)
    with pytest.raises(ConfigError, match="needs calibration samples"):
        quantize_checkpoint(base, tmp_path / "x", QuantizeOptions("fp8-static"), None, model=skeleton(base))
    assert main(["quantize", str(base), str(tmp_path / "y"), "--scheme", "fp8-static", "--calibration",
                 str(tmp_path / "missing.jsonl")]) == 2


def test_the_output_directory_never_destroys_the_weights_nor_mixes_with_another_checkpoint(base, tmp_path, capsys):
    """The model's own directory as the output is refused before anything is written (its weights are intact); a
    non-empty output directory is refused unless --overwrite, which replaces the checkpoint files there (a stale
    shard index included) and serves."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).write_bytes((base / name).read_bytes())
    before = (model / "model.safetensors").read_bytes()
    args = ["--scheme", "w8a8-int8"]
    assert main(["quantize", str(model), str(model), *args]) == 2
    assert "the model's own directory" in capsys.readouterr().err
    assert (model / "model.safetensors").read_bytes() == before and "quantization_config" not in (
        model / "config.json").read_text()
    used = tmp_path / "used"
    used.mkdir()
    (used / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {"x": "gone.safetensors"}}')
    assert main(["quantize", str(model), str(used), *args]) == 2
    assert "not empty (model.safetensors.index.json)" in capsys.readouterr().err
    assert main(["quantize", str(model), str(used), *args, "--overwrite"]) == 0
    assert not (used / "model.safetensors.index.json").exists()
    from kestrel import LLM, SamplingParams

    llm = LLM(str(used), tokenizer=str(base), dtype="float32", max_model_len=64)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_outlier_injection_keeps_the_function_and_makes_outliers(tmp_path):
    from kestrel.bench.quant_accuracy import OUTLIER_CHANNELS, OUTLIER_SCALE, inject_outliers
    from kestrel.tiny import default_model_path

    src = Path(default_model_path())
    dst = inject_outliers(src, tmp_path / "outliers")
    a = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    b = transformers.AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[1]]) % a.config.vocab_size
    seen = {}
    b.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        expected, got = a(ids).logits, b(ids).logits
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-4
    x = seen["x"][0].abs().amax(0)
    others = x[[c for c in range(x.numel()) if c not in OUTLIER_CHANNELS]]
    assert float(x[list(OUTLIER_CHANNELS)].min()) > OUTLIER_SCALE / 4 * float(others.median())


def test_declared_kv_cache_scheme_without_scales_is_an_error(base, tmp_path):
    from safetensors.torch import save_file

    from kestrel import LLM

    out = tmp_path / "kv"
    quantize_checkpoint(base, out, QuantizeOptions("fp8-dynamic", kv_cache_fp8=True), samples(), model=skeleton(base))
    tensors = {k: v for k, v in load_file(str(out / "model.safetensors")).items() if not k.endswith(("k_scale",
                                                                                                    "v_scale"))}
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ConfigError, match="kv_cache_scheme"):
        LLM(str(out), dtype="float32", max_model_len=128, kv_cache_dtype="fp8")


def test_requantized_fused_shards_share_one_scale(base, tmp_path):
    from kestrel.bench.quant_accuracy import requantize_fused_shards

    out = tmp_path / "t"
    quantize_checkpoint(base, out, QuantizeOptions("fp8-static", weight_strategy="tensor"), samples(),
                        model=skeleton(base))
    before = load_file(str(out / "model.safetensors"))
    requantize_fused_shards(out)
    after = load_file(str(out / "model.safetensors"))
    qkv = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    scales = [float(before[n + ".weight_scale"]) for n in qkv]
    assert len(set(scales)) == 3  # distinct per-tensor scales as written
    assert {float(after[n + ".weight_scale"]) for n in qkv} == {max(scales)}
    for n in qkv:  # the same weights, re-rounded on the coarser grid
        w0 = before[n + ".weight"].float() * before[n + ".weight_scale"]
        w1 = after[n + ".weight"].float() * after[n + ".weight_scale"]
        assert float((w1 - w0).abs().max()) <= float(w0.abs().max()) * 2.0**-3
