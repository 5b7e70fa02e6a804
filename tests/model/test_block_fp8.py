"""Block-FP8 checkpoints (vLLM's `fp8` format with `weight_block_size`: `weight` e4m3 and `weight_scale_inv
[ceil(N/bn), ceil(K/bk)]`, as the Qwen3 FP8 releases and DeepSeek-V3) and compressed-tensors FP8 weight-only and
`FP8_BLOCK` checkpoints: dense layers on the weight-only kernel with model-dtype activations
(`kestrel.quant.fp8_weight_only`), experts on the fused MoE kernel's block path.

Checkpoints written here in the published layout from tiny random models (small blocks, since the block size is read
from the config; one with N and K no multiple of the block, Phi-3's merged q/k/v rows sharing a block, bf16 scales
as Qwen writes them), and by llm-compressor (FP8_BLOCK, and FP8 weights without input quantization). Oracle:
transformers' float model holding the dequantized weights (for Qwen3-MoE, its experts run with their inputs and
intermediate e4m3 fake-quantized per token and bk columns, as the fused kernel does): fp32 logits within 1e-4,
greedy tokens identical. Tensor parallelism 2 over gloo matches one process within 1e-5; what does not fit (a
row-parallel rank's slice that cuts a block, a block the kernel cannot step through, static inputs with block
weights) is a ConfigError naming the setting.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gloo_ranks import run_ranks
from safetensors.torch import load_file, save_file
from test_hf_parity import PagedBatch, assert_rel_close, hf_logits, random_prompts

from kestrel import ops
from kestrel.config import ConfigError, ModelConfig, QuantConfig
from kestrel.distributed.parallel import ParallelContext, init_parallel, shutdown_parallel
from kestrel.loader import load_model
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.layers.linear import LinearBase
from kestrel.quant import FUSED_MOE, Fp8FusedMoEMethod, QuantPlan
from kestrel.quant.fp8_weight_only import Fp8BlockLinearMethod, Fp8WeightOnlyLinearMethod

transformers = pytest.importorskip("transformers")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
PROMPTS = random_prompts(1000, [5, 29, 12, 40], seed=3)
TIMEOUT_S = 120


# ------------------------------------------------------------------------------------------ writing checkpoints


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` -> (e4m3 `[N, K]`, scales `[ceil(N/bn), ceil(K/bk)]` = block absmax / 448), partial edge blocks."""
    (N, K), (bn, bk) = w.shape, block
    rows, cols = math.ceil(N / bn), math.ceil(K / bk)
    padded = F.pad(w.float(), (0, cols * bk - K, 0, rows * bn - N)).reshape(rows, bn, cols, bk)
    scale = (padded.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (padded / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(rows * bn, cols * bk)[:N, :K].contiguous(), scale


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    (N, K), (bn, bk) = q.shape, block
    return q.double() * scale.double().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]


def quantized_module(name: str, tensor: torch.Tensor) -> bool:
    """A linear weight the published checkpoints quantize: not the embedding, LM head or routers."""
    module = name.removesuffix(".weight")
    return (name.endswith(".weight") and tensor.dim() == 2 and not name.startswith(("model.embed_tokens", "lm_head"))
            and not module.endswith(".mlp.gate"))


def write_block_fp8(base: Path, out: Path, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32,
                    **config_changes) -> dict[str, torch.Tensor]:
    """vLLM's block-FP8 layout of `base` (Qwen's config: the LM head and routers in `modules_to_not_convert`);
    returns each quantized module's dequantized float64 weight."""
    shutil.copytree(base, out)
    written, dense = {}, {}
    for name, tensor in load_file(str(base / "model.safetensors")).items():
        if quantized_module(name, tensor):
            q, scale = quantize_block(tensor, block)
            scale = scale.to(scale_dtype)
            written[name], written[name.removesuffix(".weight") + ".weight_scale_inv"] = q, scale
            dense[name] = dequantize_block(q, scale, block)
        else:
            written[name] = tensor
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    skipped = ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"])]
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block), "modules_to_not_convert": skipped,
                                     **config_changes}
    (out / "config.json").write_text(json.dumps(config))
    return dense


def load(path: Path, parallel: ParallelContext | None = None) -> torch.nn.Module:
    return load_model(ModelConfig(model=str(path), dtype="float32"), None, "cpu", parallel)


def kestrel_logits(path: Path, parallel: ParallelContext | None = None) -> list[torch.Tensor]:
    return PagedBatch(load(path, parallel), len(PROMPTS)).step(PROMPTS, [(0, len(p)) for p in PROMPTS])


def reference_model(base: Path, dense: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' float model of `base` holding the dequantized linear weights."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    state = model.state_dict()
    assert set(dense) <= set(state)
    model.load_state_dict({**state, **{k: v.float() for k, v in dense.items()}})
    return model


def assert_matches(path: Path, reference: torch.nn.Module) -> None:
    for prompt, ours in zip(PROMPTS, kestrel_logits(path), strict=True):
        ref = hf_logits(reference, prompt)
        assert_rel_close(ours, ref)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def fp8_weight_only_layers(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules()
            if isinstance(m, LinearBase) and type(m.quant_method) is Fp8WeightOnlyLinearMethod]


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """Tiny random checkpoints: hidden 64, intermediate 128, head_dim 16; Qwen3-MoE's 4 experts of 32."""
    root = tmp_path_factory.mktemp("bases")
    for arch in ("llama", "phi3", "qwen3_moe"):
        write_tiny_checkpoint(root / arch, arch=arch, seed=6)
    return {arch: root / arch for arch in ("llama", "phi3", "qwen3_moe")}


# ---------------------------------------------------------------------------------------------- dense models

# name -> (arch, block, scale dtype)
DENSE = {
    "llama-32x32": ("llama", (32, 32), torch.float32),
    # N = 64 / 32 / 128 rows and K = 64 / 128 features in blocks of 48: partial blocks on both sides; bf16 scales
    "llama-48x48-bf16-scales": ("llama", (48, 48), torch.bfloat16),
    # q/k/v (64 + 32 + 32 rows) stored merged: a 48-row block spans q and k
    "phi3-merged-48x48": ("phi3", (48, 48), torch.float32),
}


@pytest.mark.parametrize("name", list(DENSE))
def test_dense_block_fp8_matches_the_dequantized_float_model(bases, tmp_path, name) -> None:
    arch, block, scale_dtype = DENSE[name]
    dense = write_block_fp8(bases[arch], tmp_path / name, block, scale_dtype)
    model = load(tmp_path / name)
    layers = fp8_weight_only_layers(model)
    assert len(layers) == 4 * len(list(model.decoder_layers()))  # qkv, o, gate_up, down
    assert model.model.layers[0].self_attn.qkv_proj.wna16_qweight.dtype == FP8
    assert_matches(tmp_path / name, reference_model(bases[arch], dense))


# ---------------------------------------------------------------------- fp8_block_activations="fp8": W8A8 blocks

W8A8 = QuantConfig(fp8_block_activations="fp8")


def block_w8a8_layers(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules()
            if isinstance(m, LinearBase) and isinstance(m.quant_method, Fp8BlockLinearMethod)]


# name -> (arch, block); bk a multiple of 32 (the W8A8 kernel's K step)
W8A8_CASES = {"llama-32x32": ("llama", (32, 32)), "phi3-merged-48x64": ("phi3", (48, 64))}


@pytest.mark.parametrize("name", list(W8A8_CASES))
def test_w8a8_block_layers_follow_the_checkpoints_fake_quantized_forward(bases, tmp_path, name) -> None:
    """With fp8_block_activations="fp8" every dense block layer runs W8A8 as the checkpoint asks: transformers' float
    model holding the dequantized weights, each quantized layer's input fake-quantized to e4m3 per token and bk
    features, gives the same logits to float32 rounding."""
    arch, block = W8A8_CASES[name]
    dense = write_block_fp8(bases[arch], tmp_path / name, block)
    model = load_model(ModelConfig(model=str(tmp_path / name), dtype="float32"), W8A8, "cpu", None)
    assert len(block_w8a8_layers(model)) == 4 * len(list(model.decoder_layers())) and not fp8_weight_only_layers(model)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == FP8
    assert_follows_fake_quantized_inputs(model, reference_model(bases[arch], dense), dense, block[1])
    # Without the flag the same checkpoint keeps its inputs in the model dtype (weight-only).
    weight_only = load(tmp_path / name)
    assert fp8_weight_only_layers(weight_only) and not block_w8a8_layers(weight_only)


def assert_follows_fake_quantized_inputs(model: torch.nn.Module, reference: torch.nn.Module,
                                         dense: dict[str, torch.Tensor], group: int) -> None:
    """`model`'s logits are `reference`'s (float, the dequantized weights `dense`) with each quantized layer's input
    fake-quantized to e4m3 per token and `group` features, to float32 rounding."""
    quantized = {n.removesuffix(".weight") for n in dense}
    for module_name, module in reference.named_modules():
        if module_name in quantized:
            module.register_forward_pre_hook(
                lambda _m, args: (fake_quant(args[0].reshape(-1, args[0].shape[-1]), group)
                                  .float().reshape(args[0].shape),))
    # The CPU references sum in the oracle's order; the fast CPU paths reorder, and an e4m3 rounding of the next
    # layer's input can turn such a last-bit difference into a visible one.
    # Even so the two sums round apart in the last bit now and then, and where that moves an input across an e4m3
    # rounding boundary the position (and the later ones, through its K/V) moves by up to an e4m3 step of one
    # value: most positions agree to float32 rounding, none by more than such a step.
    with ops.cpu_references():
        logits = PagedBatch(model, len(PROMPTS)).step(PROMPTS, [(0, len(p)) for p in PROMPTS])
    errors = []
    for prompt, got in zip(PROMPTS, logits, strict=True):
        ref = hf_logits(reference, prompt)
        errors += [float((g - r).norm() / r.norm()) for g, r in zip(got, ref, strict=True)]
    assert max(errors) < 1e-2 and sorted(errors)[len(errors) // 2] < 1e-6, errors


def test_w8a8_llm_compressor_fp8_block_checkpoint_follows_its_fake_quantized_forward(bases, tmp_path) -> None:
    """compressed-tensors FP8_BLOCK (llm-compressor's preset: [128, 128] weight blocks, inputs per token and 128
    features): under fp8_block_activations="fp8", its fake-quantized forward."""
    path = llm_compressor_checkpoint(bases["llama"], tmp_path / "FP8_BLOCK", "FP8_BLOCK")
    model = load_model(ModelConfig(model=str(path), dtype="float32"), W8A8, "cpu", None)
    assert len(block_w8a8_layers(model)) == 8
    dense = ct_dequantized(path)
    assert_follows_fake_quantized_inputs(model, reference_model(bases["llama"], dense), dense, 128)


def test_fp8_block_activations_is_refused_where_no_layer_asks_for_it(bases, tmp_path) -> None:
    with pytest.raises(ConfigError, match="fp8_block_activations='fp8'.*no quantization_config"):
        load_model(ModelConfig(model=str(bases["llama"]), dtype="float32"), W8A8, "cpu", None)
    write_block_fp8(bases["llama"], tmp_path / "k48", (32, 48))
    with pytest.raises(ConfigError, match=r"weight_block_size=\[32, 48\].*fp8_block_activations='fp8'.*multiple of 32"):
        load_model(ModelConfig(model=str(tmp_path / "k48"), dtype="float32"), W8A8, "cpu", None)


# ------------------------------------------------------------------------------------------ mixture of experts


def fake_quant(y: torch.Tensor, group: int) -> torch.Tensor:
    """e4m3 fake quantization per row and `group` columns, as the fused MoE kernel quantizes its inputs."""
    R, C = y.shape
    G = math.ceil(C / group)
    blocks = F.pad(y.float(), (0, G * group - C)).reshape(R, G, group)
    s = (blocks.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (blocks * (1.0 / s)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (q.double() * s.double()).reshape(R, G * group)[:, :C]


def block_fp8_experts_forward(experts: torch.nn.Module, group: int):
    """transformers' Qwen3-MoE experts with e4m3 per-token-group inputs and intermediates, float64."""
    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros(hidden_states.shape, dtype=torch.float64)
        xq = fake_quant(hidden_states, group)
        inter = experts.down_proj.shape[-1]
        for t in range(hidden_states.shape[0]):
            for j in range(top_k_index.shape[1]):
                e = int(top_k_index[t, j])
                gate_up = experts.gate_up_proj[e].double() @ xq[t]
                act = (F.silu(gate_up[:inter]) * gate_up[inter:]).float()
                out[t] += float(top_k_weights[t, j]) * (experts.down_proj[e].double() @ fake_quant(act[None], group)[0])
        return out.to(hidden_states.dtype)

    return forward


def test_qwen3_moe_block_fp8_attention_and_experts_load_end_to_end(bases, tmp_path) -> None:
    """The published Qwen3-MoE FP8 layout: attention and every expert in blocks, LM head and routers unquantized."""
    block = (16, 16)
    dense = write_block_fp8(bases["qwen3_moe"], tmp_path / "moe", block)
    model = load(tmp_path / "moe")
    assert len(fp8_weight_only_layers(model)) == 2 * len(list(model.decoder_layers()))  # qkv and o
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.quant_method, Fp8FusedMoEMethod) and experts.w13_weight.dtype == FP8
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32

    per_expert = {k: v for k, v in dense.items() if ".experts." in k}
    reference = reference_model(bases["qwen3_moe"], {k: v for k, v in dense.items() if k not in per_expert})
    for i, layer in enumerate(reference.model.layers):
        hf_experts = layer.mlp.experts
        prefix = f"model.layers.{i}.mlp.experts"
        with torch.no_grad():
            for e in range(hf_experts.num_experts):
                hf_experts.gate_up_proj[e] = torch.cat([per_expert[f"{prefix}.{e}.{p}.weight"]
                                                        for p in ("gate_proj", "up_proj")]).float()
                hf_experts.down_proj[e] = per_expert[f"{prefix}.{e}.down_proj.weight"].float()
        hf_experts.forward = block_fp8_experts_forward(hf_experts, block[1])
    assert_matches(tmp_path / "moe", reference)


# ------------------------------------------------------------------------------------------ compressed-tensors


def llm_compressor_checkpoint(base: Path, out: Path, how: str) -> Path:
    llmcompressor = pytest.importorskip("llmcompressor")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if how == "FP8_BLOCK":
        recipe = QuantizationModifier(targets="Linear", scheme="FP8_BLOCK", ignore=["lm_head"])
    else:  # W8A16-FP8: e4m3 weights, no input quantization
        weights = QuantizationArgs(num_bits=8, type="float", strategy=how, symmetric=True,
                                   block_structure=[32, 32] if how == "block" else None)
        recipe = QuantizationModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"],
                                                                                   weights=weights)},
                                      ignore=["lm_head"])
    llmcompressor.oneshot(model=model, recipe=recipe)
    model.save_pretrained(str(out), save_compressed=True)
    return out


def ct_dequantized(path: Path) -> dict[str, torch.Tensor]:
    """Each FP8 module's weight times its scale (per channel or per block, read from the scale's shape)."""
    tensors = load_file(str(path / "model.safetensors"))
    dense = {}
    for name, q in tensors.items():
        if q.dtype != FP8:
            continue
        scale = tensors[name.removesuffix(".weight") + ".weight_scale"].double()
        (N, K), (R, C) = q.shape, scale.shape
        dense[name] = dequantize_block(q, scale, (math.ceil(N / R), math.ceil(K / C)))
    return dense


@pytest.mark.parametrize("how", ["FP8_BLOCK", "channel", "block"])
def test_llm_compressor_fp8_checkpoints_match_the_dequantized_float_model(bases, tmp_path, how) -> None:
    path = llm_compressor_checkpoint(bases["llama"], tmp_path / how, how)
    group = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["type"] == "float" and group["weights"]["strategy"] == how.removeprefix("FP8_").lower()
    assert bool(group.get("input_activations")) == (how == "FP8_BLOCK")
    dense = ct_dequantized(path)
    assert len(dense) == 7 * 2
    assert len(fp8_weight_only_layers(load(path))) == 8
    assert_matches(path, reference_model(bases["llama"], dense))


def test_compressed_tensors_block_experts_and_weight_only_experts() -> None:
    experts = "model.layers.0.mlp.experts"
    parts = [f"{experts}.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    args = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    block = {**args, "strategy": "block", "block_structure": [128, 128]}
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "group",
              "group_size": 128}

    def plan(weights: dict, input_activations: dict | None) -> QuantPlan:
        group = {"targets": ["Linear"], "weights": weights, "format": "float-quantized"}
        if input_activations:
            group["input_activations"] = input_activations
        return QuantPlan.build(None, {"quantization_config": {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": group}}})

    method = plan(block, inputs).method_for(experts, parts, FUSED_MOE)
    assert isinstance(method, Fp8FusedMoEMethod) and method.block_shape == (128, 128)
    assert method.block_scale_name == "weight_scale"
    with pytest.raises(ConfigError, match=r"experts of 'model\.layers\.0\.mlp\.experts'.*FP8 weight-only"):
        plan({**args, "strategy": "channel"}, None).method_for(experts, parts, FUSED_MOE)
    with pytest.raises(ConfigError, match="static input scales with block weights"):
        plan(block, {**inputs, "dynamic": False})
    with pytest.raises(ConfigError, match="input_activations.*per group of 128"):
        plan(block, {**inputs, "strategy": "token", "group_size": None})
    with pytest.raises(ConfigError, match=r"weights.block_structure=\[128\]"):
        plan({**block, "block_structure": [128]}, inputs)


# ------------------------------------------------------------------------------------------ tensor parallelism

TP_CASES = {"llama-32x32": ("llama", (32, 32)), "qwen3-moe-16x16": ("qwen3_moe", (16, 16))}


def tp_rank_main(rank: int, ports: list[int], root: str) -> None:
    torch.set_num_threads(1)
    parallel = init_parallel(rank, 2, 1, f"tcp://127.0.0.1:{ports[0]}", "gloo", TIMEOUT_S)
    try:
        for name in TP_CASES:
            logits = kestrel_logits(Path(root) / name, parallel)
            torch.save(torch.cat(logits), Path(root) / f"{name}-rank{rank}.pt")
    finally:
        shutdown_parallel()


def test_tensor_parallel_two_ranks_match_one_process(bases, tmp_path) -> None:
    """Column layers split rows (each with its block's scales), row layers split K by whole blocks, experts split
    their intermediate dimension by whole blocks; partial products summed over gloo."""
    for name, (arch, block) in TP_CASES.items():
        write_block_fp8(bases[arch], tmp_path / name, block)
    run_ranks(tp_rank_main, 2, 1, tmp_path, TIMEOUT_S)
    for name in TP_CASES:
        oracle = torch.cat(kestrel_logits(tmp_path / name))
        for rank in range(2):
            ours = torch.load(tmp_path / f"{name}-rank{rank}.pt")
            assert ours.shape == oracle.shape
            assert float((ours - oracle).abs().max()) <= 1e-5 * float(oracle.abs().max()), name


# ------------------------------------------------------------------------------------------ refusals


def test_a_row_parallel_slice_that_cuts_a_block_is_refused_naming_the_layer(bases, tmp_path) -> None:
    """Blocks of 48 along K: o_proj's 64 input features give each of 2 ranks 32, two thirds of a block."""
    write_block_fp8(bases["llama"], tmp_path / "m", (48, 48))
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 for layer 'model\.layers\.0\.self_attn\.o_proj'"
                                          r".*weight_block_size=\[48, 48\]"):
        load(tmp_path / "m", ParallelContext(rank=0, tp_size=2, pp_size=1))


def test_unsupported_settings_are_config_errors_naming_them(bases, tmp_path) -> None:
    write_block_fp8(bases["llama"], tmp_path / "k8", (32, 8))
    with pytest.raises(ConfigError, match=r"weight_block_size=\[32, 8\].*multiple of 16"):
        load(tmp_path / "k8")
    write_block_fp8(bases["llama"], tmp_path / "static", (32, 32), activation_scheme="static")
    with pytest.raises(ConfigError, match="activation_scheme='static' with weight_block_size"):
        load(tmp_path / "static")
    write_block_fp8(bases["llama"], tmp_path / "odd", (32, 32), weight_block_size=[32, 0])
    with pytest.raises(ConfigError, match="weight_block_size=.*two positive integers"):
        load(tmp_path / "odd")


def test_a_weight_that_is_not_fp8_is_refused(bases, tmp_path) -> None:
    write_block_fp8(bases["llama"], tmp_path / "m", (32, 32))
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj\.weight: torch\.float32 in the checkpoint"):
        load(tmp_path / "m")


def test_experts_in_blocks_under_an_fp8_dot_are_refused_on_a_gpu() -> None:
    """An e4m3 tensor-core dot reduces over at least 32: on a GPU, FP8 experts in blocks of 16 columns are a
    ConfigError naming the field at load, not a compile failure in the first forward; the CPU runs them."""
    from types import SimpleNamespace

    method = Fp8FusedMoEMethod(prequantized=True, block_shape=(16, 16))
    on_gpu = SimpleNamespace(prefix="model.layers.0.mlp.experts", w13_weight=SimpleNamespace(is_cuda=True))
    with pytest.raises(ConfigError, match=r"weight_block_size=\[16, 16\] for model\.layers\.0\.mlp\.experts.*32"):
        method.process_after_loading(on_gpu)
    on_cpu = SimpleNamespace(prefix="model.layers.0.mlp.experts", w13_weight=torch.zeros(1),
                             w13_weight_scale=torch.ones(1), w2_weight_scale=torch.ones(1))
    method.process_after_loading(on_cpu)
