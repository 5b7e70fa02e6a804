"""Weight-only 4- and 8-bit checkpoints (GPTQ, AWQ GEMM, compressed-tensors pack-quantized / int-quantized) load
and run on the weight-only GEMM (`kestrel.quant.wna16`, the CPU reference of `ops.wna16_gemm` here).

Two sources:
- llm-compressor itself (its W4A16 and W8A16 presets, an asymmetric group-32 W4A16 and a GPTQ-rounded one) on tiny
  random Llama, Qwen3 and Phi-3 models (Phi-3 stores q/k/v and gate/up merged, so llm-compressor quantizes the
  merged modules whole). Oracle: the checkpoint's own fake-quantized forward, transformers with compressed-tensors;
  every kestrel linear layer fed the input the oracle's layer saw gives its output to float32 rounding, and the
  logits match transformers' float model with the linear weights replaced by the checkpoint's dequantized ones
  (dequantized here with compressed-tensors' own unpacking) within 1e-4.
- checkpoints written here from known integer codes in each writer's documented layout (GPTQ v1 and v2 zero points,
  symmetric and asymmetric, per group and per channel, act-order g_idx shared by the parts that read one input;
  AWQ's interleaved nibbles; compressed-tensors act-order `weight_g_idx` as older llm-compressor wrote it, and
  int-quantized): logits within 1e-4 of transformers' float model holding the dequantized weights.

Tensor parallelism 2 over gloo (group-quantized and per-channel checkpoints) matches one process within 1e-5; act-order
on a row-parallel layer, groups cut by a rank's slice, and unsupported variants are ConfigErrors naming the layer or
the setting.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks
from safetensors.torch import load_file, save_file
from test_hf_parity import REL_TOL, PagedBatch, assert_rel_close, hf_logits, random_prompts

from kestrel.config import ConfigError, ModelConfig
from kestrel.distributed.parallel import init_parallel, shutdown_parallel
from kestrel.loader import load_model
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.layers.linear import LinearBase, MergedColumnLinear, RowLinear
from kestrel.quant import FUSED_MOE, QuantPlan, UnquantizedLinearMethod, WNA16LinearMethod

transformers = pytest.importorskip("transformers")

PROMPTS = random_prompts(1000, [5, 29, 12, 40], seed=3)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of a word holds column 8j + AWQ_ORDER[i]
TIMEOUT_S = 120
# q, k and v read one input, as do gate and up: GPTQ's act-order permutation (from that input's Hessian) is shared.
SAME_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


# ------------------------------------------------------------------------------------------ writing checkpoints


def pack(codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned codes -> int32 words along `dim`: element pf*j + order[i] at bits bits*i of word j."""
    pf = 32 // bits
    v = codes.movedim(dim, -1).to(torch.int64)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // pf, pf)[..., list(order or range(pf))]
    words = (v << (torch.arange(pf) * bits)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def write_weight_only(base: Path, out: Path, layout: str, bits: int, group: int, sym: bool, act_order: bool = False,
                      v1: bool = True, keep_float: str | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """`base`'s checkpoint with every `*_proj` module (but those whose name matches `keep_float`) replaced by random
    integer codes, scales and zero points in `layout`'s tensors; returns each such module's dequantized float32
    weight `[N, K]`, `W[n, k] = s[g(k), n] * (q[k, n] - z[g(k), n])`."""
    shutil.copytree(base, out)
    tensors = load_file(str(base / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}
    saved, dense = {}, {}
    for name, weight in tensors.items():
        module = name.removesuffix(".weight")
        if not name.endswith("_proj.weight") or (keep_float and keep_float in module):
            saved[name] = weight
            continue
        N, K = weight.shape
        size = group if group > 0 else K
        G = K // size
        g_idx = torch.arange(K) // size
        if act_order:
            parent, leaf = module.rsplit(".", 1)
            key = f"{parent}.{SAME_INPUT.get(leaf, leaf)}"
            if key not in orders:
                orders[key] = torch.empty(K, dtype=torch.int64).index_copy_(0, torch.randperm(K, generator=gen),
                                                                            torch.arange(K) // size)
            g_idx = orders[key]
        top = 2**bits
        q = torch.randint(0, top, (K, N), generator=gen)
        if sym:
            z = torch.full((G, N), top // 2)
        else:
            z = torch.randint(0, top, (G, N), generator=gen)
            z[0, 0], z[-1, -1] = 0, top - 1  # GPTQ v1 stores zero - 1: 0 wraps to top - 1
        s = ((torch.rand(G, N, generator=gen) + 0.5) * 0.08 / top).to(torch.float16)
        dense[name] = (s.double()[g_idx] * (q - z[g_idx]).double()).T.float().contiguous()
        if layout == "gptq":
            saved.update({f"{module}.qweight": pack(q, bits, 0), f"{module}.scales": s,
                          f"{module}.qzeros": pack((z - 1) % top if v1 else z, bits, 1),
                          f"{module}.g_idx": g_idx.to(torch.int32)})
        elif layout == "awq":
            saved.update({f"{module}.qweight": pack(q, 4, 1, AWQ_ORDER), f"{module}.qzeros": pack(z, 4, 1, AWQ_ORDER),
                          f"{module}.scales": s})
        else:  # compressed-tensors: signed values (code - top / 2), [N, K] layout
            scale = s.T.to(torch.bfloat16).contiguous()
            dense[name] = (scale.double().T[g_idx] * (q - z[g_idx]).double()).T.float().contiguous()
            if layout == "pack-quantized":
                saved.update({f"{module}.weight_packed": pack(q.T, bits, 1),
                              f"{module}.weight_shape": torch.tensor([N, K])})
            else:
                saved[f"{module}.weight"] = (q.T - top // 2).to(torch.int8).contiguous()
            saved[f"{module}.weight_scale"] = scale
            if not sym:
                saved[f"{module}.weight_zero_point"] = (pack(z.T, bits, 0) if layout == "pack-quantized"
                                                        else (z.T - top // 2).to(torch.int8).contiguous())
            if act_order:
                saved[f"{module}.weight_g_idx"] = g_idx.to(torch.int32)
    save_file(saved, str(out / "model.safetensors"), metadata={"format": "pt"})
    set_quantization_config(out, quantization_config(layout, bits, group, sym, act_order, v1))
    return dense


def quantization_config(layout: str, bits: int, group: int, sym: bool, act_order: bool, v1: bool) -> dict:
    if layout == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym,
                "checkpoint_format": "gptq" if v1 else "gptq_v2", "damp_percent": 0.01, "static_groups": False,
                "true_sequential": True}
    if layout == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "group" if group > 0 else "channel", "group_size": group if group > 0 else None,
               "actorder": "group" if act_order else None}
    return {"quant_method": "compressed-tensors", "format": layout, "ignore": ["lm_head"], "quantization_status":
            "compressed", "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                        "input_activations": None, "format": layout}}}


def set_quantization_config(path: Path, quantization: dict) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization
    (path / "config.json").write_text(json.dumps(config))


def reference_model(base: Path, dense: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' float model of `base` with the given linear weights (the dequantized ones)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    state = model.state_dict()
    assert set(dense) <= set(state)
    model.load_state_dict({**state, **dense})
    return model


def kestrel_logits(path: Path, parallel=None) -> list[torch.Tensor]:
    model = load_model(ModelConfig(model=str(path), dtype="float32"), None, "cpu", parallel)
    return PagedBatch(model, len(PROMPTS)).step(PROMPTS, [(0, len(p)) for p in PROMPTS])


def assert_logits_match(path: Path, reference: torch.nn.Module) -> None:
    for prompt, ours in zip(PROMPTS, kestrel_logits(path), strict=True):
        assert_rel_close(ours, hf_logits(reference, prompt))


def weight_only_layers(path: Path) -> dict[str, str]:
    """Each weight-only linear layer of the loaded model -> its kernel weight type."""
    model = load_model(ModelConfig(model=str(path), dtype="float32"))
    return {name: m.quant_method.weight_type for name, m in model.named_modules()
            if isinstance(m, LinearBase) and isinstance(m.quant_method, WNA16LinearMethod)}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """Tiny random checkpoints (hidden 64, intermediate 128, head_dim 16: groups of 32 fit every layer)."""
    root = tmp_path_factory.mktemp("bases")
    paths = {}
    for arch in ("llama", "qwen2", "phi3"):
        write_tiny_checkpoint(root / arch, arch=arch, seed=5)
        paths[arch] = root / arch
    return paths


# ------------------------------------------------------------------------ checkpoints written from integer codes

# name -> (arch, layout, bits, group size (-1: per channel), symmetric, act-order, GPTQ v1 zeros)
HAND_WRITTEN = {
    "gptq-4bit-sym-g32": ("llama", "gptq", 4, 32, True, False, True),
    "gptq-4bit-asym-g32-actorder": ("llama", "gptq", 4, 32, False, True, True),
    "gptq-4bit-sym-actorder-qwen2-bias": ("qwen2", "gptq", 4, 32, True, True, True),
    "gptq-4bit-asym-channel": ("llama", "gptq", 4, -1, False, False, True),
    "gptq-8bit-asym-g32-v2": ("llama", "gptq", 8, 32, False, False, False),
    "gptq-8bit-sym-channel": ("llama", "gptq", 8, -1, True, False, True),
    "gptq-4bit-asym-actorder-phi3-merged": ("phi3", "gptq", 4, 32, False, True, True),
    "awq-g32": ("llama", "awq", 4, 32, False, False, True),
    "awq-g64-phi3-merged": ("phi3", "awq", 4, 64, False, False, True),
    "ct-pack-4bit-asym-g32-actorder": ("llama", "pack-quantized", 4, 32, False, True, True),
    "ct-int-8bit-asym-channel": ("llama", "int-quantized", 8, -1, False, False, True),
    "ct-int-4bit-sym-g32": ("qwen2", "int-quantized", 4, 32, True, False, True),
}
WEIGHT_TYPE = {(4, True): "int4", (4, False): "uint4", (8, True): "int8", (8, False): "int8"}


@pytest.mark.parametrize("name", list(HAND_WRITTEN))
def test_written_checkpoints_match_the_dequantized_float_model(bases, tmp_path, name) -> None:
    arch, layout, bits, group, sym, act_order, v1 = HAND_WRITTEN[name]
    dense = write_weight_only(bases[arch], tmp_path / name, layout, bits, group, sym, act_order, v1)
    layers = weight_only_layers(tmp_path / name)
    assert len(layers) == 4 * 2 and set(layers.values()) == {WEIGHT_TYPE[bits, sym]}
    assert_logits_match(tmp_path / name, reference_model(bases[arch], dense))


def test_modules_a_gptq_rule_excludes_stay_float(bases, tmp_path) -> None:
    """`dynamic` "-:" rules leave modules unquantized: their float `weight` loads beside the GPTQ layers."""
    path = tmp_path / "gptq-dynamic"
    dense = write_weight_only(bases["llama"], path, "gptq", 4, 32, sym=False, keep_float="layers.1.mlp")
    config = quantization_config("gptq", 4, 32, False, False, True)
    set_quantization_config(path, {**config, "dynamic": {r"-:model\.layers\.1\.mlp\..*": {}}})
    assert len(weight_only_layers(path)) == 4 * 2 - 2
    assert_logits_match(path, reference_model(bases["llama"], dense))


# ----------------------------------------------------------------------------------- llm-compressor's checkpoints


def _int_weights(bits: int, strategy: str, group: int | None, symmetric: bool, actorder: str | None = None):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=bits, type="int", strategy=strategy, group_size=group, symmetric=symmetric,
                            actorder=actorder)
    return QuantizationScheme(targets=["Linear"], weights=args)


# name -> (arch, config.json overrides, how): the presets, an asymmetric group-32 scheme, and GPTQ-rounded weights
LLM_COMPRESSOR = {
    # The presets: groups of 128, symmetric (hidden 128, head_dim 32: every layer's input is whole groups)
    "llama-W4A16": ("llama", {"hidden_size": 128, "intermediate_size": 256}, "W4A16"),
    "qwen3-W8A16": ("qwen3", {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}, "W8A16"),
    "qwen3-W4A16-asym-g32": ("qwen3", {}, "asym-g32"),
    "llama-W8A16-asym-channel": ("llama", {}, "asym-channel-8bit"),
    "phi3-W4A16-g32": ("phi3", {}, "sym-g32"),
    "llama-GPTQ-W4A16-asym-g32": ("llama", {}, "gptq-asym-g32"),
    # GPTQModifier with the W4A16 preset (groups of 128, its default static act-order)
    "llama-GPTQ-W4A16": ("llama", {"hidden_size": 128, "intermediate_size": 256}, "gptq-W4A16"),
}


def llm_compressor_checkpoint(base: Path, out: Path, how: str) -> Path:
    llmcompressor = pytest.importorskip("llmcompressor")
    from datasets import Dataset
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    kwargs = {}
    if how in ("W4A16", "W8A16"):
        recipe = QuantizationModifier(targets="Linear", scheme=how, ignore=["lm_head"])
    elif how in ("asym-g32", "sym-g32"):
        recipe = QuantizationModifier(config_groups={"group_0": _int_weights(4, "group", 32, how == "sym-g32")},
                                      ignore=["lm_head"])
    elif how == "asym-channel-8bit":
        recipe = QuantizationModifier(config_groups={"group_0": _int_weights(8, "channel", None, False)},
                                      ignore=["lm_head"])
    else:
        recipe = (GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]) if how == "gptq-W4A16" else
                  GPTQModifier(config_groups={"group_0": _int_weights(4, "group", 32, False, "weight")},
                               ignore=["lm_head"]))
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(3, 1000, (32,), generator=g).tolist() for _ in range(16)]
        kwargs = {"dataset": Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 32 for _ in ids]}),
                  "num_calibration_samples": 16, "max_seq_length": 32}
    llmcompressor.oneshot(model=model, recipe=recipe, **kwargs)
    model.save_pretrained(str(out), save_compressed=True)
    return out


@pytest.fixture(scope="module", params=list(LLM_COMPRESSOR))
def compressed(request, tmp_path_factory) -> tuple[Path, Path]:
    arch, overrides, how = LLM_COMPRESSOR[request.param]
    base = tmp_path_factory.mktemp(f"base-{request.param}")
    write_tiny_checkpoint(base, arch=arch, seed=4, **overrides)
    return base, llm_compressor_checkpoint(base, tmp_path_factory.mktemp(request.param), how)


def dequantized_weights(path: Path) -> dict[str, torch.Tensor]:
    """Each quantized module's float weight, from its tensors by compressed-tensors' own unpacking."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    group_config = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    bits = group_config["weights"]["num_bits"]
    tensors = load_file(str(path / "model.safetensors"))
    dense = {}
    for name in tensors:
        if not name.endswith(".weight_packed"):
            continue
        module = name.removesuffix(".weight_packed")
        shape = torch.Size(tensors[f"{module}.weight_shape"].tolist())
        q = unpack_from_int32(tensors[name], bits, shape).double()
        scale = tensors[f"{module}.weight_scale"].double()
        zp = tensors.get(f"{module}.weight_zero_point")
        z = torch.zeros_like(scale) if zp is None else unpack_from_int32(zp, bits, scale.shape, packed_dim=0).double()
        group = shape[1] // scale.shape[1]
        w = (q - z.repeat_interleave(group, 1)) * scale.repeat_interleave(group, 1)
        dense[f"{module}.weight"] = w.float()
    return dense


def test_every_linear_layer_matches_the_fake_quantized_forward(compressed) -> None:
    _, path = compressed
    oracle = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [m.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, (args[0], out)))
             for name, m in oracle.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    with torch.no_grad():
        oracle(torch.tensor([PROMPTS[3]]))
    for h in hooks:
        h.remove()
    ours = load_model(ModelConfig(model=str(path), dtype="float32"))
    checked = 0
    for name, module in ours.named_modules():
        if not isinstance(module, LinearBase):
            continue
        assert isinstance(module.quant_method, WNA16LinearMethod), name
        prefix, leaf = name.rsplit(".", 1)
        parts = [f"{prefix}.{p}" for p in ours.packed_modules_mapping.get(leaf, (leaf,))]
        x = seen[parts[0]][0][0]
        ref = torch.cat([seen[p][1][0] for p in parts], dim=-1)
        with torch.no_grad():
            got = module(x)
        # Both dequantize exactly in float32 and differ by the summation order only.
        bound = 1e-5 * ref.abs().amax(dim=-1, keepdim=True) + 1e-6
        assert bool(((got - ref).abs() <= bound).all()), f"{name}: max error {(got - ref).abs().max():.3e}"
        checked += 1
    assert checked == 4 * oracle.config.num_hidden_layers


def test_logits_match_the_float_model_with_dequantized_weights(compressed) -> None:
    base, path = compressed
    reference = reference_model(base, dequantized_weights(path))
    float_model = reference_model(base, {})
    for prompt, ours in zip(PROMPTS, kestrel_logits(path), strict=True):
        ref = hf_logits(reference, prompt)
        assert_rel_close(ours, ref)
        # The quantization itself moves the logits ten times the bound or more: a lost quantization would show.
        assert (hf_logits(float_model, prompt) - ref).abs().max() > 10 * REL_TOL * ref.abs().max()


# ------------------------------------------------------------------------------------------- tensor parallelism

TP_CASES = ("gptq-4bit-asym-g32", "gptq-4bit-asym-channel", "awq-g32", "ct-pack-8bit-asym-g32")
TP_SETTINGS = {"gptq-4bit-asym-g32": ("gptq", 4, 32), "gptq-4bit-asym-channel": ("gptq", 4, -1),
               "awq-g32": ("awq", 4, 32), "ct-pack-8bit-asym-g32": ("pack-quantized", 8, 32)}


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
    """Column layers split N (packed zero points and AWQ words by whole words), row layers split K by whole groups
    (per-channel scales stay whole), partial products summed over gloo."""
    for name in TP_CASES:
        layout, bits, group = TP_SETTINGS[name]
        write_weight_only(bases["llama"], tmp_path / name, layout, bits, group, sym=False, seed=7)
    run_ranks(tp_rank_main, 2, 1, tmp_path, TIMEOUT_S)
    for name in TP_CASES:
        oracle = torch.cat(kestrel_logits(tmp_path / name))
        for rank in range(2):
            ours = torch.load(tmp_path / f"{name}-rank{rank}.pt")
            assert ours.shape == oracle.shape
            assert float((ours - oracle).abs().max()) <= 1e-5 * float(oracle.abs().max()), name


def gptq_plan(**settings) -> QuantPlan:
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True, **settings}
    return QuantPlan.build(None, {"quantization_config": config})


def test_act_order_on_a_row_parallel_layer_is_refused_naming_it() -> None:
    plan = gptq_plan(desc_act=True)
    down = plan.method_for("model.layers.0.mlp.down_proj")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 for layer 'model.layers.0.mlp.down_proj'.*"
                                          "act-order"):
        RowLinear(128, 64, quant_method=down, tp_size=2, tp_rank=1)
    # One rank holds every input feature: act-order runs; so do column layers under tensor parallelism, and row
    # layers whose groups stay contiguous runs of features (static groups, or one group per channel).
    RowLinear(128, 64, quant_method=plan.method_for("model.layers.0.mlp.down_proj"))
    for contiguous in (gptq_plan(desc_act=True, static_groups=True), gptq_plan(desc_act=True, group_size=-1)):
        RowLinear(128, 64, quant_method=contiguous.method_for("model.layers.0.mlp.down_proj"), tp_size=2, tp_rank=1)
    parts = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    MergedColumnLinear(64, [128, 128], quant_method=plan.method_for("model.layers.0.mlp.gate_up_proj", parts),
                       tp_size=2, tp_rank=0)


def test_a_rank_slice_must_hold_whole_groups() -> None:
    method = gptq_plan(group_size=64).method_for("model.layers.0.self_attn.o_proj")
    with pytest.raises(ConfigError, match=r"group_size=64 for layer 'model.layers.0.self_attn.o_proj'.*32 input "
                                          r"features per rank \(tensor_parallel_size=2\)"):
        RowLinear(64, 64, quant_method=method, tp_size=2, tp_rank=0)
    method = gptq_plan(sym=False).method_for("model.layers.0.self_attn.qkv_proj", ["q_proj", "k_proj", "v_proj"])
    with pytest.raises(ConfigError, match="packs 8 output features per int32"):
        MergedColumnLinear(64, [24, 24], quant_method=method, tp_size=2, tp_rank=0)


# --------------------------------------------------------------------------------------------- which modules

LAYER0 = "model.layers.0"
QKV = (f"{LAYER0}.self_attn.qkv_proj", [f"{LAYER0}.self_attn.{p}_proj" for p in "qkv"])


def test_modules_in_block_to_quantize_and_dynamic_rules_choose_the_modules() -> None:
    blocks = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"]]
    plan = gptq_plan(modules_in_block_to_quantize=blocks)
    assert isinstance(plan.method_for(*QKV), WNA16LinearMethod)
    assert isinstance(plan.method_for(f"{LAYER0}.mlp.down_proj"), UnquantizedLinearMethod)
    with pytest.raises(ConfigError, match="merged into model.layers.0.self_attn.qkv_proj.*different schemes"):
        gptq_plan(modules_in_block_to_quantize=[["self_attn.q_proj"]]).method_for(*QKV)
    plan = gptq_plan(dynamic={r"-:.*layers\.1\..*": {}, r"+:.*down_proj": {"bits": 8, "group_size": -1}})
    assert isinstance(plan.method_for("model.layers.1.mlp.down_proj"), UnquantizedLinearMethod)
    down = plan.method_for(f"{LAYER0}.mlp.down_proj").spec
    assert (down.bits, down.group_size) == (8, -1)
    assert plan.method_for(*QKV).spec.bits == 4
    awq = QuantPlan.build(None, {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32,
                                                         "modules_to_not_convert": ["mlp"]}})
    assert isinstance(awq.method_for(f"{LAYER0}.mlp.down_proj"), UnquantizedLinearMethod)
    assert isinstance(awq.method_for(*QKV), WNA16LinearMethod)


def _ct(weights: dict, fmt: str = "pack-quantized", inputs: dict | None = None) -> dict:
    group = {"targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32,
                                                **weights}, "input_activations": inputs}
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": group}}


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv_fast"}, "version='gemv_fast'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 32}, r"bits=8 \(quant_method='awq'\)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": False}, "zero_point=False"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, r"bits=3 \(quant_method='gptq'\)"),
    ({"quant_method": "gptq", "bits": 2, "group_size": 32}, "bits=2"),
    ({"quant_method": "gptq", "bits": 4}, "group_size=None"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 24}, "group_size=24.*multiples of 16"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
     "checkpoint_format='marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "is_marlin_format": True}, "is_marlin_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "dynamic": {"+:.*down": {"damp_percent": 0.1}}},
     r"dynamic\['\+:\.\*down'\].*damp_percent"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "dynamic": {"+:.*down": {"bits": 3}}},
     r"dynamic\['\+:\.\*down'\]\.bits=3"),
    (_ct({"num_bits": 3}), r"weights.num_bits=3 in config group 'group_0'"),
    (_ct({"strategy": "tensor"}), "weights.strategy='tensor' in config group 'group_0'"),
    (_ct({"group_size": 8}), "weights.group_size=8"),
    (_ct({"dynamic": True}), "weights.dynamic=True"),
    (_ct({}, inputs={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
     "format 'pack-quantized' in config group 'group_0'"),  # W4A8: no kernel
    # FP8 weight-only loads (tests/model/test_block_fp8.py); asymmetric FP8 weights do not
    (_ct({"type": "float", "num_bits": 8, "strategy": "channel", "group_size": None, "symmetric": False},
         fmt="float-quantized"), "weights must be symmetric"),
])
def test_unsupported_variants_are_config_errors_naming_the_setting(config, message) -> None:
    with pytest.raises(ConfigError, match=message):
        QuantPlan.build(None, {"quantization_config": config})


def test_quantized_lm_head_and_experts_are_refused() -> None:
    with pytest.raises(ConfigError, match="lm_head=True"):
        gptq_plan(lm_head=True).check_unquantized("lm_head")
    gptq_plan().check_unquantized("lm_head")
    experts = ("model.layers.0.mlp.experts", ["model.layers.0.mlp.experts.0.up_proj"])
    with pytest.raises(ConfigError, match="scheme 'gptq' has no method for fused_moe layers"):
        gptq_plan().method_for(*experts, kind=FUSED_MOE)
    ct = QuantPlan.build(None, {"quantization_config": _ct({})})
    with pytest.raises(ConfigError, match="experts of 'model.layers.0.mlp.experts' to W4A16"):
        ct.method_for(*experts, kind=FUSED_MOE)


def test_a_g_idx_that_contradicts_the_config_is_refused(bases, tmp_path) -> None:
    path = tmp_path / "lying"
    write_weight_only(bases["llama"], path, "gptq", 4, 32, sym=True, act_order=True)
    set_quantization_config(path, quantization_config("gptq", 4, 32, True, False, True))  # desc_act: false
    with pytest.raises(ConfigError, match="desc_act.*reorders its input features"):
        load_model(ModelConfig(model=str(path), dtype="float32"))
