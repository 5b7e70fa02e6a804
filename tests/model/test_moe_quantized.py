"""W8A8-FP8 experts in the mixture-of-experts families, end to end on CPU (the fused MoE kernel's reference):

- quantized at load (`quantization="fp8"`): each expert's output channels at absmax / 448; the MoE layer against a
  float64 fake-quantized oracle written here (dequantized weights, per-token fake-quantized activations: x, and
  the intermediate after its rounding to the model dtype) to float32 rounding; the logits of every MoE family
  within the quantized tests' cosine bound, counted per GEMM of each layer;
- checkpoints: compressed-tensors FP8_DYNAMIC written by llm-compressor 0.14 itself (its post-load linearization of
  transformers' fused experts into per-expert Linear modules, routers in the ignore list), against the
  checkpoint's fake-quantized forward (transformers with the same linearized experts, dequantized weights and
  per-token FP8 inputs); vLLM's block-FP8 format (`weight_block_size`, `weight_scale_inv`) for experts, written
  here, against the float64 oracle;
- what is refused, naming the layer: INT8 experts, static expert input scales, experts of mixed schemes, a
  quantized router, static inputs with block weights, a tensor-parallel share that cuts a scale block (dense
  block-FP8 layers load weight-only: tests/model/test_block_fp8.py);
- tensor parallelism (intermediate split) and expert parallelism over 2 gloo processes within 1e-5 of one process,
  for FP8 at load, a per-channel checkpoint and a block checkpoint.
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
from test_quantized import GEMMS_PER_LAYER, cosine_bound, last_logits

from kestrel import ops
from kestrel.config import ConfigError, ModelConfig, QuantConfig
from kestrel.distributed.parallel import ParallelContext, init_parallel, shutdown_parallel
from kestrel.loader import load_model
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.quant import (
    FUSED_MOE,
    UNQUANTIZED,
    Fp8FusedMoEMethod,
    QuantPlan,
    UnquantizedFusedMoEMethod,
    UnquantizedLinearMethod,
)
from kestrel.quant.fp8_weight_only import Fp8WeightOnlyLinearMethod

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MOE_FAMILIES = ("mixtral", "qwen2-moe", "qwen3-moe", "olmoe")
PROMPT_LENS = [1, 5, 17, 33, 40, 9, 24, 3]
BLOCK = (16, 16)  # the tiny experts' intermediate size is 32: two blocks, one per rank at tp=2
TIMEOUT_S = 180


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def load(path: Path, quant: QuantConfig | None = None, parallel: ParallelContext | None = None) -> torch.nn.Module:
    return load_model(ModelConfig(model=str(path), dtype="float32"), quant, "cpu", parallel)


# ------------------------------------------------------------------------------------ checkpoints written here


def _quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale  # a 0-dim scale, as AutoFP8 wrote them


def _quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    (N, K), (bn, bk) = w.shape, block
    rows, cols = math.ceil(N / bn), math.ceil(K / bk)
    padded = F.pad(w.float(), (0, cols * bk - K, 0, rows * bn - N)).reshape(rows, bn, cols, bk)
    scale = (padded.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (padded / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(rows * bn, cols * bk)[:N, :K].contiguous(), scale


def _is_linear(name: str, tensor: torch.Tensor) -> bool:
    """A linear module's weight the checkpoint may quantize: not the embedding, LM head, norms or routers."""
    module = name.removesuffix(".weight")
    return (name.endswith(".weight") and tensor.dim() == 2 and not name.startswith(("model.embed_tokens", "lm_head"))
            and not module.endswith((".gate", ".shared_expert_gate")))


def write_fp8_checkpoint(base: Path, out: Path, fmt: str, block: tuple[int, int] = BLOCK) -> Path:
    """`fmt` "channel": compressed-tensors FP8_DYNAMIC as llm-compressor writes it (every linear module, experts
    included: `weight` e4m3 and `weight_scale [N, 1]`; LM head and routers ignored). "tensor": vLLM's FP8 format
    with per-tensor weights (`weight_scale []`) and dynamic activations, the same modules. "block": vLLM's FP8
    format with `weight_block_size` (`weight_scale_inv [ceil(N/bn), ceil(K/bk)]`), the experts only, every other
    linear module in `modules_to_not_convert`."""
    shutil.copytree(base, out)
    tensors = load_file(str(base / "model.safetensors"))
    written, skipped = {}, []
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if fmt in ("channel", "tensor") and _is_linear(name, tensor):
            quantize = _quantize_channel if fmt == "channel" else _quantize_tensor
            written[name], written[module + ".weight_scale"] = quantize(tensor)
        elif fmt == "block" and ".experts." in name:
            written[name], written[module + ".weight_scale_inv"] = _quantize_block(tensor, block)
        else:
            written[name] = tensor
            if name.endswith(".weight") and tensor.dim() == 2 and not name.startswith("model.embed_tokens"):
                skipped.append(module)
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    if fmt == "channel":
        args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                          "weights": {**args, "strategy": "channel", "dynamic": False},
                                          "input_activations": {**args, "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$"]}
    elif fmt == "tensor":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "ignored_layers": skipped}
    else:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                         "weight_block_size": list(block), "modules_to_not_convert": skipped}
    (out / "config.json").write_text(json.dumps(config))
    return out


def with_quantization_config(src: Path, out: Path, **changes) -> Path:
    """A copy of `src` whose quantization_config has `changes` (None removes an entry)."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config["quantization_config"].pop(key, None)
        else:
            config["quantization_config"][key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


# ------------------------------------------------------------------------------------ the float64 oracle


def fake_quant(y: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """e4m3 fake quantization per row (per row and `group` columns), float64: s = max(absmax / 448, 1e-12) and
    q = rne(sat(y * (1 / s))) in float32, as the kernels quantize."""
    y = y.float()
    R, C = y.shape
    g = C if group is None else group
    G = math.ceil(C / g)
    blocks = F.pad(y, (0, G * g - C)).reshape(R, G, g)
    s = (blocks.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (blocks * (1.0 / s)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (q.double() * s.double()).reshape(R, G * g)[:, :C]


def dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """`[E, N, K]` fp8 times per-channel `[E, N, 1]` or block `[E, ceil(N/bn), ceil(K/bk)]` scales, float64."""
    if block is None:
        return w.double() * scale.double().reshape(*w.shape[:2], 1)
    E, N, K = w.shape
    full = scale.double().repeat_interleave(block[0], 1)[:, :N].repeat_interleave(block[1], 2)[:, :, :K]
    return w.double() * full


def experts_oracle(experts: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   block: tuple[int, int] | None) -> torch.Tensor:
    """float64: sum_j w[t, j] * W2[e] fq(round_dtype(silu(W13g[e] fq(x)) * W13u[e] fq(x))), with the layer's own
    stored FP8 weights and scales (gate and up rows of w13, down w2) and e4m3 fake-quantized activations."""
    w13 = dequantize(experts.w13_weight, experts.w13_weight_scale, block)
    w2 = dequantize(experts.w2_weight, experts.w2_weight_scale, block)
    inter = w2.shape[-1]
    group = None if block is None else block[1]
    xq = fake_quant(x, group)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w13[e] @ xq[t]
            gate = gate_up[:inter]
            act = (gate / (1 + torch.exp(-gate)) * gate_up[inter:]).to(x.dtype)  # the model-dtype intermediate
            out[t] += float(topk_weights[t, j]) * (w2[e] @ fake_quant(act[None], group)[0])
    return out


def assert_float32_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Agreement to float32 accumulation: the same fp8 values and scales, sums in another order."""
    err = (got.double() - ref).abs().max()
    assert err <= 1e-5 * ref.abs().max(), f"max error {err:.3e} of {ref.abs().max():.3e}"


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> dict[str, Path]:
    """kestrel's tiny random Qwen3-MoE (4 experts of intermediate size 32, top 2), its per-channel compressed-tensors,
    per-tensor and block-FP8 quantizations."""
    root = tmp_path_factory.mktemp("tiny-moe")
    base = root / "float"
    write_tiny_checkpoint(base, arch="qwen3_moe", seed=5)
    quantized = {fmt: write_fp8_checkpoint(base, root / fmt, fmt) for fmt in ("channel", "tensor", "block")}
    return {"float": base, **quantized}


# ------------------------------------------------------------------------------------ FP8 at load


def test_online_fp8_quantizes_each_expert_output_channel(tiny_moe) -> None:
    model = load(tiny_moe["float"], QuantConfig(method="fp8"))
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == FP8
    assert experts.w13_weight_scale.shape == (4, 64, 1) and experts.w2_weight_scale.shape == (4, 64, 1)
    tensors = load_file(str(tiny_moe["float"] / "model.safetensors"))
    prefix = "model.layers.0.mlp.experts"
    w13 = torch.stack([torch.cat([tensors[f"{prefix}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")])
                       for e in range(4)])
    w2 = torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(4)])
    for q, scale, w in ((experts.w13_weight, experts.w13_weight_scale, w13), (experts.w2_weight,
                                                                               experts.w2_weight_scale, w2)):
        torch.testing.assert_close(scale, (w.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12), rtol=0, atol=0)
        assert q.float().abs().amax(-1).eq(FP8_MAX).all()  # each row's absmax lands on 448
        # e4m3: 3 mantissa bits (2^-4 relative), plus half the subnormal step near zero
        assert ((q.float() * scale - w).abs() <= 2.0**-4 * w.abs() + 2.0**-10 * scale).all()
    # The router stays in the model dtype.
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32


@pytest.mark.parametrize("source", ["fp8-at-load", "channel", "tensor", "block"])
def test_experts_match_the_float64_fake_quantized_oracle(tiny_moe, source: str) -> None:
    path = tiny_moe["float"] if source == "fp8-at-load" else tiny_moe[source]
    model = load(path, QuantConfig(method="fp8") if source == "fp8-at-load" else None)
    mlp = model.model.layers[1].mlp
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(7))
    x[3] = 0.0  # a zero row takes the floor scale
    x[5] *= 40.0  # and a large one
    weights, ids = mlp.route(x)
    if source == "tensor":  # each module's one scale fills its rows of the per-channel scales
        tensors = load_file(str(path / "model.safetensors"))
        up = tensors["model.layers.1.mlp.experts.2.up_proj.weight_scale"]
        assert up.dim() == 0 and bool((mlp.experts.w13_weight_scale[2, 32:] == up).all())
    with torch.no_grad():
        got = mlp.experts(x, weights, ids, "silu")
    ref = experts_oracle(mlp.experts, x, weights, ids, BLOCK if source == "block" else None)
    assert_float32_close(got, ref)
    # the whole block: the experts plus nothing else in Qwen3-MoE
    with torch.no_grad():
        assert torch.equal(mlp(x), got)


def gemm_count(model: torch.nn.Module) -> int:
    """The quantized GEMMs a token goes through: each layer's qkv and o, and its MLP's two (experts: the routed
    w13 and w2, a shared expert's two more)."""
    count = 0
    for layer in model.decoder_layers():
        count += 2
        mlp = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
        count += 2 + (2 if getattr(mlp, "has_shared_expert", False) else 0)
    return count


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def family_at_init_scale(request, tmp_path_factory) -> tuple[str, Path]:
    """The family written by transformers at its initializer's scale (std 0.02), as the cosine bound assumes."""
    from test_families import write_family

    return request.param, write_family(tmp_path_factory.mktemp(f"{request.param}-init"), request.param, seed=1,
                                       spread=0.02)


def test_fp8_at_load_logits_stay_close(family_at_init_scale) -> None:
    _, path = family_at_init_scale
    reference_model = load(path)
    prompts = prompts_for(reference_model.config.vocab_size)
    reference = last_logits(reference_model, prompts)
    model = load(path, QuantConfig(method="fp8"))
    experts = [m for m in model.modules() if type(m).__name__ == "FusedExperts"]
    assert experts and all(m.w13_weight.dtype == FP8 for m in experts)
    cos = F.cosine_similarity(last_logits(model, prompts).double(), reference.double(), dim=-1)
    bound = cosine_bound("fp8", gemm_count(model) / GEMMS_PER_LAYER)
    assert cos.min() >= bound, f"min cosine {cos.min():.6f} < bound {bound:.6f} ({cos.tolist()})"


def test_fp8_at_load_runs_in_the_engine_bfloat16(tiny_moe) -> None:
    """The engine path in bf16: greedy tokens equal the argmax of the quantized model's own logits."""
    from kestrel import LLM, SamplingParams

    llm = LLM(str(tiny_moe["float"]), dtype="bfloat16", max_model_len=64, quantization="fp8")
    prompts = prompts_for(llm.runner.model.config.vocab_size)[:4]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outputs)
    experts = llm.runner.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == FP8
    direct = last_logits(llm.runner.model, prompts).argmax(dim=-1).tolist()
    assert [o.outputs[0].token_ids[0] for o in outputs] == direct


# ------------------------------------------------------------------------------------ refusals


def test_the_plan_hands_experts_and_routers_their_methods() -> None:
    experts = "model.layers.0.mlp.experts"
    parts = [f"{experts}.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    assert isinstance(QuantPlan().method_for(experts, parts, FUSED_MOE), UnquantizedFusedMoEMethod)
    online = QuantPlan(QuantConfig(method="fp8")).method_for(experts, parts, FUSED_MOE)
    assert isinstance(online, Fp8FusedMoEMethod) and not online.prequantized and online.block_shape is None
    block = QuantPlan.build(None, {"quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}})
    method = block.method_for(experts, parts, FUSED_MOE)
    assert isinstance(method, Fp8FusedMoEMethod) and method.prequantized and method.block_shape == (128, 128)
    assert isinstance(block.method_for("model.layers.0.mlp.gate", (), UNQUANTIZED), UnquantizedLinearMethod)
    with pytest.raises(ConfigError, match=r"quantizes 'model\.layers\.1\.mlp\.gate'"):
        block.method_for("model.layers.1.mlp.gate", (), UNQUANTIZED)
    assert isinstance(block.method_for("model.layers.0.mlp.down_proj"), Fp8WeightOnlyLinearMethod)
    with pytest.raises(ConfigError, match="weight_block_size=.*two positive integers"):
        QuantPlan.build(None, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}})
    # quantization at load has nothing saved to refuse: the router just stays in the model dtype
    assert isinstance(QuantPlan(QuantConfig(method="fp8")).method_for("model.layers.0.mlp.gate", (), UNQUANTIZED),
                      UnquantizedLinearMethod)


def test_int8_refuses_experts_naming_the_layer(tiny_moe) -> None:
    for config in (QuantConfig(method="int8"), QuantConfig(method="int8", symmetric_activations=False)):
        with pytest.raises(ConfigError, match=r"experts of 'model\.layers\.0\.mlp\.experts' to INT8"):
            load(tiny_moe["float"], config)


def test_unsupported_expert_checkpoints_are_refused_naming_the_layer(tiny_moe, tmp_path) -> None:
    channel = tiny_moe["channel"]
    config = json.loads((channel / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]
    cases = {
        # the router quantized (no ignore entry for it)
        "router": ({"ignore": ["lm_head"]}, r"quantizes 'model\.layers\.0\.mlp\.gate'"),
        # static input scales: the kernel quantizes the experts' inputs per token
        "static": ({"config_groups": {"group_0": {**group, "input_activations": {
            **group["input_activations"], "strategy": "tensor", "dynamic": False}}}}, "static input scales"),
        # INT8 experts
        "int8": ({"format": "int-quantized", "config_groups": {"group_0": {
            **group, "format": "int-quantized", "weights": {**group["weights"], "type": "int"},
            "input_activations": {**group["input_activations"], "type": "int"}}}}, "INT8"),
        # one expert left unquantized
        "mixed": ({"ignore": [*config["ignore"], "re:.*experts\\.1\\."]}, "different schemes"),
    }
    for name, (changes, message) in cases.items():
        path = with_quantization_config(channel, tmp_path / name, **changes)
        with pytest.raises(ConfigError, match=message):
            load(path)


def test_block_fp8_static_activations_are_refused(tiny_moe, tmp_path) -> None:
    path = with_quantization_config(tiny_moe["block"], tmp_path / "static", activation_scheme="static")
    with pytest.raises(ConfigError, match="block-wise FP8 weights take dynamic activations"):
        load(path)


def test_kestrel_quantize_refuses_mixture_of_experts_models(tiny_moe) -> None:
    """Its targets come from the model: experts are no linear layers of it, and the routers would be quantized."""
    from kestrel.loader.hf_config import load_hf_config
    from kestrel.model.registry import get_model_class
    from kestrel.quant.calibrate import QuantTargets

    config = load_hf_config(str(tiny_moe["float"]))
    with torch.device("meta"):
        model = get_model_class(config["architectures"][0])(config)
    with pytest.raises(ConfigError, match=r"mixture-of-experts layers \(model\.layers\.0\.mlp\.experts\)"):
        QuantTargets.of_model(model)


def test_a_rank_share_that_cuts_a_scale_block_is_refused(tiny_moe) -> None:
    """tp=4 leaves each rank 8 of the 32 intermediate rows, half a 16-row block (refused while building)."""
    parallel = ParallelContext(rank=0, tp_size=4, pp_size=1)
    with pytest.raises(ConfigError, match="not a multiple of 16"):
        load(tiny_moe["block"], parallel=parallel)
    # whole experts per rank keep whole blocks
    load(tiny_moe["block"], parallel=ParallelContext(rank=0, tp_size=4, pp_size=1, expert_parallel=True))


# ------------------------------------------------------------------------------------ llm-compressor


def llmcompressor_fp8_dynamic(base: Path, out: Path, router: str) -> Path:
    """llm-compressor's FP8_DYNAMIC preset on the float checkpoint (no calibration data: weights per channel,
    inputs per token). Its oneshot linearizes transformers' fused experts into per-expert Linear modules."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("llmcompressor")
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    recipe = QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC",
                                  ignore=["lm_head", f"re:.*{router}$", "re:.*shared_expert_gate$"])
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(str(out), save_compressed=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (base / name).is_file():
            shutil.copy(base / name, out / name)
    return out


# Mixtral's experts are `w1` / `w3` / `w2` in its checkpoints (and in vLLM's and kestrel's loaders); llm-compressor
# 0.14 on transformers 5 saves the linearized modules' own names (gate_proj / up_proj / down_proj), which
# transformers itself then fails to load: renamed to the published layout here.
MIXTRAL_PARTS = {".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}


def rename_mixtral_experts(path: Path) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {}
    for name, tensor in tensors.items():
        if ".experts." in name:
            for old, new in MIXTRAL_PARTS.items():
                name = name.replace(old, new)
        renamed[name] = tensor
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})


LLMC_CASES = {"qwen3-moe": "mlp.gate", "qwen2-moe": "mlp.gate", "mixtral": "block_sparse_moe.gate", "olmoe": "mlp.gate"}


@pytest.fixture(scope="module", params=list(LLMC_CASES))
def llmc_checkpoint(request, tmp_path_factory) -> tuple[str, Path, Path]:
    from test_families import write_family

    family = request.param
    base = write_family(tmp_path_factory.mktemp(f"{family}-base"), family, seed=2, spread=0.05)
    out = llmcompressor_fp8_dynamic(base, tmp_path_factory.mktemp(f"{family}-fp8-dynamic"), LLMC_CASES[family])
    if family == "mixtral":
        rename_mixtral_experts(out)
    return family, base, out


def fake_quantized_oracle(base: Path, path: Path, block: tuple[int, int] | None = None) -> torch.nn.Module:
    """The checkpoint's fake-quantized forward: transformers' float architecture with its experts linearized into
    per-expert Linear modules (llm-compressor's own `linearize_moe`, as its oneshot did), every stored weight
    dequantized (per-channel `weight_scale`, or `weight_scale_inv` per `block`), and each quantized module's input
    fake-quantized to e4m3 per token (and per `block[1]` columns)."""
    pytest.importorskip("llmcompressor")
    from llmcompressor.modeling.moe.linearize import linearize_moe

    model = transformers_model(base)
    linearize_moe(model)
    tensors = load_file(str(path / "model.safetensors"))
    suffix = ".weight_scale" if block is None else ".weight_scale_inv"
    state, quantized = {}, set()
    for name, tensor in tensors.items():
        if name.endswith(suffix):
            continue
        scale = tensors.get(name.removesuffix(".weight") + suffix)
        # transformers names Mixtral's block `mlp`, and the linearized experts gate/up/down
        ours = name.replace(".block_sparse_moe.", ".mlp.")
        for new, old in MIXTRAL_PARTS.items():
            ours = ours.replace(old, new) if ".experts." in ours else ours
        state[ours] = tensor.float() if scale is None else dequantize(tensor[None], scale[None], block)[0].float()
        if scale is not None:
            quantized.add(ours.removesuffix(".weight"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    group = None if block is None else block[1]

    def fake_quant_input(_module, args):
        return (fake_quant(args[0].reshape(-1, args[0].shape[-1]), group).float().reshape(args[0].shape),)

    for name, module in model.named_modules():
        if name in quantized:
            assert isinstance(module, torch.nn.Linear), name
            module.register_forward_pre_hook(fake_quant_input)
    assert any(".experts.3.down_proj" in name for name in quantized)
    return model


def test_llmcompressor_fp8_dynamic_checkpoint_loads_and_follows_its_fake_quantized_forward(llmc_checkpoint):
    family, base, path = llmc_checkpoint
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(path / "model.safetensors"))
    expert = "model.layers.0." + ("block_sparse_moe.experts.0.w1" if family == "mixtral" else "mlp.experts.0.gate_proj")
    assert tensors[expert + ".weight"].dtype == FP8 and tensors[expert + ".weight_scale"].shape[1] == 1
    assert any("gate" in entry for entry in config["ignore"])  # the routers
    ours = load(path)
    hf = fake_quantized_oracle(base, path)
    # Per MoE layer: kestrel's experts fed the oracle's input and routing give the oracle's experts output.
    seen = []
    hooks = [layer.mlp.experts.register_forward_hook(
        lambda m, args, out, i=i: seen.append((i, args, out))) for i, layer in enumerate(hf.model.layers)
        if hasattr(layer.mlp, "experts")]
    prompts = prompts_for(ours.config.vocab_size, seed=4)
    with torch.no_grad():
        hf(torch.tensor([prompts[3]]))
    for h in hooks:
        h.remove()
    assert seen
    for i, (x, ids, weights), out in seen:
        mlp = ours.model.layers[i].block_sparse_moe if family == "mixtral" else ours.model.layers[i].mlp
        with torch.no_grad():
            got = mlp.experts(x.reshape(-1, x.shape[-1]), weights.float(), ids, "silu")
        ref = out.reshape(got.shape).double()
        err = (got.double() - ref).abs().max()
        assert err <= 1e-5 * ref.abs().max(), f"layer {i}: max error {err:.3e} of {ref.abs().max():.3e}"
    # End to end: closer to the checkpoint's forward than the float model is.
    float_model = transformers_model(base)
    for prompt, got in zip(prompts, last_logits(ours, prompts), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1]
            full = float_model(torch.tensor([prompt])).logits[0, -1]
        quant_effect = float((ref - full).norm() / full.norm())
        error = float((got - ref).norm() / ref.norm())
        assert error < quant_effect, f"logits {error:.4f} from the checkpoint, quantization moved {quant_effect:.4f}"


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_block_fp8_experts_follow_the_checkpoints_fake_quantized_forward_end_to_end(family, tmp_path) -> None:
    """Experts only (the dense layers stay in float32): kestrel's logits are the oracle's to float32 rounding."""
    from test_families import write_family

    base = write_family(tmp_path / "base", family, seed=2, spread=0.05)
    path = write_fp8_checkpoint(base, tmp_path / "block", "block")
    ours = load(path)
    hf = fake_quantized_oracle(base, path, BLOCK)
    prompts = prompts_for(ours.config.vocab_size, seed=4)
    # To float32 rounding: the CPU references, whose sums run in the oracle's order. The fast CPU paths reorder
    # them, and the FP8 activation rounding can turn such a last-bit difference into a visible one.
    with ops.cpu_references():
        logits = last_logits(ours, prompts)
    for prompt, got in zip(prompts, logits, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1]
        assert float((got - ref).norm() / ref.norm()) < 1e-5


def transformers_model(path: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------ TP = 2, EP = 2

LAYOUTS = (("tp2", False), ("tp2-ep", True))
TP_CASES = (("qwen2_moe", "fp8-at-load"), ("qwen2_moe", "channel"), ("qwen2_moe", "tensor"), ("qwen3_moe", "block"))


def case_path(root: Path, arch: str, source: str) -> Path:
    return root / (arch if source == "fp8-at-load" else f"{arch}-{source}")


def run_case(root: Path, arch: str, source: str, parallel: ParallelContext | None = None) -> torch.Tensor:
    model = load(case_path(root, arch, source), QuantConfig(method="fp8") if source == "fp8-at-load" else None,
                 parallel)
    return last_logits(model, prompts_for(model.config.vocab_size, seed=6))



def rank_main(rank: int, ports: list[int], root: str) -> None:
    torch.set_num_threads(1)
    for (layout, ep), port in zip(LAYOUTS, ports):
        parallel = init_parallel(rank, 2, 1, f"tcp://127.0.0.1:{port}", "gloo", TIMEOUT_S, ep)
        try:
            for arch, source in TP_CASES:
                logits = run_case(Path(root), arch, source, parallel)
                torch.save(logits, Path(root) / f"{arch}-{source}-{layout}-rank{rank}.pt")
        finally:
            shutdown_parallel()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe-tp")
    for arch in {arch for arch, _ in TP_CASES}:
        write_tiny_checkpoint(root / arch, arch, seed=3)
    for arch, source in TP_CASES:
        if source != "fp8-at-load":
            write_fp8_checkpoint(root / arch, case_path(root, arch, source), source)
    run_ranks(rank_main, 2, len(LAYOUTS), root, TIMEOUT_S)
    return root


@pytest.mark.parametrize(("arch", "source", "layout"), [(a, s, lay) for lay, _ in LAYOUTS for a, s in TP_CASES])
def test_sharded_fp8_experts_match_one_process(sharded: Path, arch: str, source: str, layout: str) -> None:
    oracle = run_case(sharded, arch, source)
    for rank in range(2):
        ours = torch.load(sharded / f"{arch}-{source}-{layout}-rank{rank}.pt")
        torch.testing.assert_close(ours, oracle, rtol=0, atol=1e-5)
        assert torch.equal(ours.argmax(-1), oracle.argmax(-1))
