"""bitsandbytes checkpoints (`quant_method: "bitsandbytes"`) load and run as weight-only layers (`kestrel.quant.bnb`;
the CPU reference of `ops.wna16_gemm` here).

bitsandbytes needs a GPU to quantize, so the checkpoints are written here from random codes in the layout
transformers + bitsandbytes save (bitsandbytes 0.50's `QuantState.as_dict(packed=True)` and `Linear8bitLt`'s state
dict): LLM.int8 `weight` int8 + `SCB` + `weight_format`; 4-bit `weight` `[N * K / 2, 1]` (element 2i in the high
nibble) with `weight.absmax`, `weight.quant_map`, `weight.quant_state.bitsandbytes__<type>` (JSON bytes) and, with
double quantization, uint8 absmax codes into `weight.nested_quant_map` scaled by `weight.nested_absmax` plus the JSON's
`nested_offset`. The config is transformers' own `BitsAndBytesConfig(...).to_dict()`. The oracle is transformers'
float32 model holding the weights dequantized here in float64 (`W[n, k] = book[c] * absmax[(n K + k) // blocksize]`,
LLM.int8 `weight * SCB / 127`): logits within 1e-4 of its largest, greedy tokens equal where its top two are apart.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gloo_ranks import run_ranks
from safetensors.torch import load_file, save_file
from test_hf_parity import PagedBatch, assert_rel_close, hf_logits, random_prompts

from kestrel.config import ConfigError, EngineConfig, ModelConfig, QuantConfig
from kestrel.distributed.parallel import init_parallel, shutdown_parallel
from kestrel.loader import load_model
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.layers.linear import LinearBase
from kestrel.model.loading import WeightLoadingError
from kestrel.quant import FUSED_MOE, QuantPlan, UnquantizedLinearMethod
from kestrel.quant.bnb import Bnb4bitLinearMethod, BnbInt8LinearMethod

transformers = pytest.importorskip("transformers")

PROMPTS = random_prompts(1000, [5, 29, 12, 40], seed=3)
TIMEOUT_S = 120
# bitsandbytes' code books as its get_4bit_type builds them: a float32 table divided by its largest magnitude.
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])
FP4 = torch.tensor([0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0]) / 12
BOOKS = {"nf4": NF4, "fp4": FP4}
NESTED_BLOCKSIZE = 256  # bitsandbytes double-quantizes the absmax in blocks of 256


def bnb_config(**kwargs) -> dict:
    return json.loads(json.dumps(transformers.BitsAndBytesConfig(**kwargs).to_dict()))


def write_4bit(module: str, W_shape: tuple[int, int], quant_type: str, double_quant: bool, blocksize: int,
               storage: torch.dtype, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One 4-bit module's tensors from random codes and absmax, and its float64 weight."""
    N, K = W_shape
    numel = N * K
    blocks = -(-numel // blocksize)
    codes = torch.randint(0, 16, (numel,), generator=gen)
    tensors = {}
    state = {"quant_type": quant_type, "blocksize": blocksize, "dtype": "bfloat16", "shape": [N, K]}
    if double_quant:
        q = torch.randint(0, 256, (blocks,), generator=gen, dtype=torch.int64)
        code = torch.sort(torch.rand(256, generator=gen) * 2 - 1).values
        code[0], code[-1] = -1.0, 1.0
        nested = (torch.rand(-(-blocks // NESTED_BLOCKSIZE), generator=gen) + 0.5) * 0.02
        offset = 0.05
        absmax = code.double()[q] * nested.double().repeat_interleave(NESTED_BLOCKSIZE)[:blocks] + offset
        tensors.update({"absmax": q.to(torch.uint8), "nested_absmax": nested, "nested_quant_map": code})
        state.update({"nested_blocksize": NESTED_BLOCKSIZE, "nested_dtype": "float32", "nested_offset": offset})
    else:
        absmax32 = (torch.rand(blocks, generator=gen) + 0.5) * 0.06
        absmax = absmax32.double()
        tensors["absmax"] = absmax32
    packed = ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8)  # element 2i in the high nibble
    tensors["quant_map"] = BOOKS[quant_type].clone()
    tensors[f"quant_state.bitsandbytes__{quant_type}"] = torch.tensor(list(json.dumps(state).encode()),
                                                                       dtype=torch.uint8)
    saved = {f"{module}.weight.{k}": v for k, v in tensors.items()}
    saved[f"{module}.weight"] = packed.view(storage).reshape(-1, 1)
    dense = BOOKS[quant_type].double()[codes] * absmax.repeat_interleave(blocksize)[:numel]
    return saved, dense.reshape(N, K)


def write_8bit(module: str, W_shape: tuple[int, int], gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    N, K = W_shape
    q = torch.randint(-127, 128, (N, K), generator=gen).to(torch.int8)
    scb = (torch.rand(N, generator=gen) + 0.5) * 0.06 * 127
    saved = {f"{module}.weight": q, f"{module}.SCB": scb, f"{module}.weight_format": torch.tensor(0, dtype=torch.uint8)}
    return saved, q.double() * scb.double().view(-1, 1) / 127


def write_bnb(base: Path, out: Path, quant_type: str | None, double_quant: bool = False, blocksize: int = 64,
              storage: torch.dtype = torch.uint8, skip: list[str] | None = None, seed: int = 0) -> dict:
    """`base`'s checkpoint with its `*_proj` modules in bitsandbytes' layout (quant_type None: LLM.int8), but those
    `skip` names (a suffix of the module name); returns each quantized module's float32 weight."""
    shutil.copytree(base, out)
    gen = torch.Generator().manual_seed(seed)
    saved, dense = {}, {}
    for name, weight in load_file(str(base / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if not name.endswith("_proj.weight") or any(module.endswith(s) for s in skip or ()):
            saved[name] = weight
            continue
        if quant_type is None:
            tensors, W = write_8bit(module, tuple(weight.shape), gen)
        else:
            tensors, W = write_4bit(module, tuple(weight.shape), quant_type, double_quant, blocksize, storage, gen)
        saved.update(tensors)
        dense[name] = W.float()
    save_file(saved, str(out / "model.safetensors"), metadata={"format": "pt"})
    if quant_type is None:
        quantization = bnb_config(load_in_8bit=True, llm_int8_skip_modules=skip)
    else:
        quantization = bnb_config(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                  bnb_4bit_use_double_quant=double_quant, bnb_4bit_quant_storage=str(storage)[6:],
                                  llm_int8_skip_modules=skip)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config))
    return dense


def reference_model(base: Path, dense: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    state = model.state_dict()
    assert set(dense) <= set(state)
    model.load_state_dict({**state, **dense})
    return model


def kestrel_logits(path: Path, parallel=None) -> list[torch.Tensor]:
    model = load_model(ModelConfig(model=str(path), dtype="float32"), None, "cpu", parallel)
    return PagedBatch(model, len(PROMPTS)).step(PROMPTS, [(0, len(p)) for p in PROMPTS])


def layer_kinds(path: Path) -> dict[str, str]:
    """Each linear layer -> its kernel weight type, "dense" (dequantized at load) or "float" (not quantized)."""
    model = load_model(ModelConfig(model=str(path), dtype="float32"))
    kinds = {}
    for name, m in model.named_modules():
        if isinstance(m, LinearBase):
            method = m.quant_method
            kinds[name] = ("float" if isinstance(method, UnquantizedLinearMethod)
                           else method.weight_type or "dense")
    return kinds


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """Tiny random checkpoints: hidden 64, intermediate 128 (blocks of 64 are groups of every layer's rows)."""
    root = tmp_path_factory.mktemp("bases")
    paths = {}
    for arch in ("llama", "phi3"):
        write_tiny_checkpoint(root / arch, arch=arch, seed=5)
        paths[arch] = root / arch
    return paths


# name -> (arch, quant_type (None: LLM.int8), double quant, blocksize, storage dtype, skip list)
CASES = {
    "int8": ("llama", None, False, 64, torch.uint8, None),
    "nf4": ("llama", "nf4", False, 64, torch.uint8, None),
    "nf4-double-quant": ("llama", "nf4", True, 64, torch.uint8, None),
    "fp4": ("llama", "fp4", False, 64, torch.uint8, None),
    "fp4-double-quant": ("llama", "fp4", True, 64, torch.uint8, None),
    # Blocks of 128 straddle the rows of the layers with 64 input features (dequantized at load), not down_proj's.
    "nf4-double-quant-block128-bf16-storage": ("llama", "nf4", True, 128, torch.bfloat16, None),
    "nf4-skip-down-proj": ("llama", "nf4", False, 64, torch.uint8, ["lm_head", "mlp.down_proj"]),
    "int8-phi3-merged": ("phi3", None, False, 64, torch.uint8, None),
    "nf4-double-quant-phi3-merged": ("phi3", "nf4", True, 64, torch.uint8, None),
}


def expected_kinds(name: str, layers: list[str]) -> dict[str, str]:
    arch, quant_type, _, blocksize, _, skip = CASES[name]
    kinds = {}
    for layer in layers:
        if skip and any(layer.endswith(s) for s in skip):
            kinds[layer] = "float"
        elif quant_type is None:
            kinds[layer] = "int8"
        elif blocksize > 64 and not layer.endswith("down_proj"):
            kinds[layer] = "dense"
        else:
            kinds[layer] = {"nf4": "nf4", "fp4": "fp4_bnb"}[quant_type]
    return kinds


@pytest.mark.parametrize("name", list(CASES))
def test_checkpoints_match_the_dequantized_float_model(bases, tmp_path, name) -> None:
    arch, quant_type, double_quant, blocksize, storage, skip = CASES[name]
    path = tmp_path / name
    dense = write_bnb(bases[arch], path, quant_type, double_quant, blocksize, storage, skip)
    kinds = layer_kinds(path)
    assert len(kinds) == 4 * 2 and kinds == expected_kinds(name, list(kinds))
    reference = reference_model(bases[arch], dense)
    for prompt, ours in zip(PROMPTS, kestrel_logits(path), strict=True):
        ref = hf_logits(reference, prompt)
        assert_rel_close(ours, ref)
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3 * ref.abs().max()
        assert clear.any() and torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


# ------------------------------------------------------------------------------------------- tensor parallelism

TP_CASES = ("int8", "nf4-double-quant", "nf4-double-quant-block128-bf16-storage")


def tp_rank_main(rank: int, ports: list[int], root: str) -> None:
    torch.set_num_threads(1)
    parallel = init_parallel(rank, 2, 1, f"tcp://127.0.0.1:{ports[0]}", "gloo", TIMEOUT_S)
    try:
        for name in TP_CASES:
            torch.save(torch.cat(kestrel_logits(Path(root) / name, parallel)), Path(root) / f"{name}-rank{rank}.pt")
    finally:
        shutdown_parallel()


def test_tensor_parallel_two_ranks_match_one_process(bases, tmp_path) -> None:
    """Column layers split the rows, row layers the input features: down_proj's 64 per rank are whole blocks of 64
    (the kernel), o_proj's 32 cut them (dequantized at load from the rank's share of each block); gloo sums the
    partial products."""
    for name in TP_CASES:
        arch, quant_type, double_quant, blocksize, storage, skip = CASES[name]
        write_bnb(bases[arch], tmp_path / name, quant_type, double_quant, blocksize, storage, skip, seed=7)
    run_ranks(tp_rank_main, 2, 1, tmp_path, TIMEOUT_S)
    for name in TP_CASES:
        oracle = torch.cat(kestrel_logits(tmp_path / name))
        for rank in range(2):
            ours = torch.load(tmp_path / f"{name}-rank{rank}.pt")
            assert ours.shape == oracle.shape
            assert float((ours - oracle).abs().max()) <= 1e-5 * float(oracle.abs().max()), name


# ------------------------------------------------------------------------------------------ configs and errors

LAYER0 = "model.layers.0"
QKV = (f"{LAYER0}.self_attn.qkv_proj", [f"{LAYER0}.self_attn.{p}_proj" for p in "qkv"])


def plan(**kwargs) -> QuantPlan:
    return QuantPlan.build(None, {"quantization_config": bnb_config(**kwargs)})


def test_the_config_chooses_the_method_and_the_modules() -> None:
    nf4 = plan(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    method = nf4.method_for(*QKV)
    assert isinstance(method, Bnb4bitLinearMethod) and (method.quant_type, method.double_quant) == ("nf4", True)
    assert nf4.scheme.precision == "nf4"
    nf4.check_unquantized("lm_head")  # transformers' default leaves the LM head unconverted
    int8 = plan(load_in_8bit=True, llm_int8_skip_modules=["lm_head", r"model\.layers\.1\."])
    assert isinstance(int8.method_for(f"{LAYER0}.mlp.down_proj"), BnbInt8LinearMethod)
    assert isinstance(int8.method_for("model.layers.1.mlp.down_proj"), UnquantizedLinearMethod)
    assert isinstance(int8.method_for(*QKV), BnbInt8LinearMethod)


def test_the_quantization_flag_names_the_checkpoint_format() -> None:
    hf_config = {"quantization_config": bnb_config(load_in_8bit=True)}
    assert QuantPlan.build(QuantConfig(method="bitsandbytes"), hf_config).scheme.name == "bitsandbytes"
    with pytest.raises(ConfigError, match="invalid quantization='gptq'.*quant_method='bitsandbytes'"):
        QuantPlan.build(QuantConfig(method="gptq"), hf_config)
    with pytest.raises(ConfigError, match="quantization='bitsandbytes': it names a checkpoint format"):
        QuantPlan(QuantConfig(method="bitsandbytes"))


def test_the_flag_on_an_unquantized_checkpoint_is_refused(bases) -> None:
    with pytest.raises(ConfigError, match="bitsandbytes"):
        EngineConfig.from_kwargs(str(bases["llama"]), quantization="bitsandbytes")


@pytest.mark.parametrize("config, message", [
    ({"load_in_8bit": True, "llm_int8_has_fp16_weight": True}, "llm_int8_has_fp16_weight=True"),
    ({"load_in_4bit": True, "llm_int8_enable_fp32_cpu_offload": True}, "llm_int8_enable_fp32_cpu_offload=True"),
    ({"load_in_8bit": True, "load_in_4bit": True}, "load_in_8bit=True and load_in_4bit=True"),
    ({"load_in_8bit": False, "load_in_4bit": False}, "exactly one of them"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type='int4'"),
    ({"load_in_8bit": True, "llm_int8_threshold": -1.0}, "llm_int8_threshold=-1.0"),
    ({"load_in_8bit": True, "llm_int8_skip_modules": "lm_head"}, "llm_int8_skip_modules='lm_head'"),
    ({"load_in_4bit": True, "bnb_4bit_quant_storage": "nibble"}, "bnb_4bit_quant_storage='nibble'"),
])
def test_unsupported_options_are_config_errors_naming_the_setting(config, message) -> None:
    with pytest.raises(ConfigError, match=message):
        QuantPlan.build(None, {"quantization_config": {"quant_method": "bitsandbytes", **config}})


def test_a_quantized_lm_head_merged_parts_split_by_the_skip_list_and_experts_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"llm_int8_skip_modules=\['mlp'\].*does not name 'lm_head'"):
        plan(load_in_4bit=True, llm_int8_skip_modules=["mlp"]).check_unquantized("lm_head")
    with pytest.raises(ConfigError, match="merged into model.layers.0.self_attn.qkv_proj are not all skipped"):
        plan(load_in_4bit=True, llm_int8_skip_modules=["lm_head", "q_proj"]).method_for(*QKV)
    experts = ("model.layers.0.mlp.experts", ["model.layers.0.mlp.experts.0.up_proj"])
    with pytest.raises(ConfigError, match="scheme 'bitsandbytes' has no method for fused_moe layers"):
        plan(load_in_4bit=True).method_for(*experts, kind=FUSED_MOE)


def _edit(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_tensors_that_contradict_the_config_are_named(bases, tmp_path) -> None:
    module = "model.layers.0.self_attn.q_proj"
    path = tmp_path / "other-code-book"
    write_bnb(bases["llama"], path, "nf4")
    _edit(path, lambda t: t.__setitem__(f"{module}.weight.quant_map", FP4.clone()))
    with pytest.raises(ValueError, match="quant_map is not bitsandbytes' nf4 code book"):
        load_model(ModelConfig(model=str(path), dtype="float32"))
    path = tmp_path / "fp4-state-in-nf4-config"
    write_bnb(bases["llama"], path, "nf4")

    def rename(t: dict) -> None:
        t[f"{module}.weight.quant_state.bitsandbytes__fp4"] = t.pop(f"{module}.weight.quant_state.bitsandbytes__nf4")

    _edit(path, rename)
    with pytest.raises(WeightLoadingError, match="bitsandbytes__fp4"):
        load_model(ModelConfig(model=str(path), dtype="float32"))
    path = tmp_path / "column-format"
    write_bnb(bases["llama"], path, None)
    _edit(path, lambda t: t.__setitem__(f"{module}.weight_format", torch.tensor(1, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="weight_format=\\[1\\]"):
        load_model(ModelConfig(model=str(path), dtype="float32"))


def test_fp4_code_book_is_not_e2m1() -> None:
    """bitsandbytes' FP4 (exponent bias 2, 12 normalized to 1) needs its own code book in the kernel."""
    e2m1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]) / 6
    assert not np.allclose(FP4[:8].numpy(), e2m1) and not np.allclose(np.sort(FP4[:8].numpy()), e2m1)
