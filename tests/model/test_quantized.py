"""W8A8 linear methods (FP8, INT8 symmetric and asymmetric) on CPU: one layer against a float64 oracle, then a
tiny model whose logits must stay close to the unquantized model's, also through `LLM.generate`.

The model-level tests run in float32: the CPU references compute in fp32/fp64 anyway, and a float32 model
isolates the quantization error (the only other rounding is the GEMM's bf16 output, at most 2^-8 relative, below
8-bit steps) where a bfloat16 model would add its own rounding noise of a similar size to INT8's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kestrel import LLM, SamplingParams
from kestrel.config import ConfigError, ModelConfig, QuantConfig
from kestrel.kernels.quant_act import FP8_MAX, SCALE_FLOOR
from kestrel.loader import load_model
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.layers.linear import LinearBase, QKVParallelLinear, ReplicatedLinear
from kestrel.quant import Fp8LinearMethod, Int8LinearMethod, get_quant_method
from kestrel.quant.w8a8 import W8A8LinearMethod

FP8 = QuantConfig(method="fp8")
INT8_SYM = QuantConfig(method="int8")
INT8_ASYM = QuantConfig(method="int8", symmetric_activations=False)
CONFIGS = {"fp8": FP8, "int8-sym": INT8_SYM, "int8-asym": INT8_ASYM}
# bf16 keeps 8 significant bits, so one rounding of the GEMM output is at most 2^-8 relative; 1% on top for the
# fp32 epilogue's own roundings (2^-24 each).
BF16_REL = 1.01 * 2.0**-8


def make_layer(quant_config: QuantConfig, n: int = 24, k: int = 40, bias: bool = True, dtype=torch.float32,
               seed: int = 0) -> tuple[ReplicatedLinear, torch.Tensor, torch.Tensor]:
    """A loaded, processed layer and its original weight and bias (float32)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * 0.05
    weight[3] = 0.0  # an all-zero row must get the floor scale, not 0/0
    b = torch.randn(n, generator=g) * 0.1
    layer = ReplicatedLinear(k, n, bias=bias, quant_method=get_quant_method(quant_config, "test"), params_dtype=dtype)
    layer.weight.weight_loader(layer.weight, weight.to(dtype))
    if bias:
        layer.bias.weight_loader(layer.bias, b.to(dtype))
    layer.process_after_loading()
    return layer, weight.to(dtype).float(), b.to(dtype).float()


def oracle(layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
    """float64: dequantized activations (the method's own quantizer) times dequantized weights, plus bias."""
    method: W8A8LinearMethod = layer.quant_method
    act = method.quantize_input(layer, x.reshape(-1, x.shape[-1]))
    zero = 0.0 if act.azp is None else act.azp.double().reshape(-1, 1)
    x_dq = act.scale.double().reshape(-1, 1) * (act.q.double() - zero)
    w_dq = layer.weight.double() * layer.weight_scale.double()
    out = x_dq @ w_dq.T
    if layer.bias is not None:
        out = out + layer.bias.double()
    return out.reshape(*x.shape[:-1], -1)


def assert_bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    err = (out.double() - ref).abs()
    assert (err <= BF16_REL * ref.abs() + 1e-6 * ref.abs().max()).all(), f"max error {err.max():.3e}"


# ------------------------------------------------------------------------------------------ weights


def test_registry_builds_the_w8a8_methods() -> None:
    assert isinstance(get_quant_method(FP8, "x"), Fp8LinearMethod)
    assert isinstance(get_quant_method(INT8_ASYM, "x"), Int8LinearMethod)


def test_fp8_weights_per_channel() -> None:
    layer, weight, _ = make_layer(FP8)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.shape == (24, 40)
    assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == (24, 1)
    expected_scale = (weight.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=SCALE_FLOOR)
    torch.testing.assert_close(layer.weight_scale, expected_scale, rtol=0, atol=0)
    assert layer.weight_scale[3] == SCALE_FLOOR and (layer.weight[3].float() == 0).all()
    assert layer.weight.float().abs().amax(dim=1)[[0, 1, 2, 4]].eq(FP8_MAX).all()  # each row's absmax hits 448
    # e4m3 keeps 3 mantissa bits: at most 2^-4 relative, plus half the subnormal spacing (2^-9) near zero.
    dq = layer.weight.float() * layer.weight_scale
    assert ((dq - weight).abs() <= 2.0**-4 * weight.abs() + 2.0**-10 * layer.weight_scale).all()
    assert not hasattr(layer, "azp_adj")
    assert {name for name, _ in layer.named_parameters()} == {"weight", "weight_scale", "bias"}


@pytest.mark.parametrize("config", [INT8_SYM, INT8_ASYM], ids=["sym", "asym"])
def test_int8_weights_per_channel(config: QuantConfig) -> None:
    layer, weight, _ = make_layer(config)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (24, 1)
    assert layer.weight.min() >= -127
    torch.testing.assert_close(layer.weight_scale, (weight.abs().amax(1, keepdim=True) / 127).clamp(min=SCALE_FLOOR),
                               rtol=0, atol=0)
    dq = layer.weight.float() * layer.weight_scale
    assert ((dq - weight).abs() <= 0.5001 * layer.weight_scale).all()
    if config.symmetric_activations:
        assert not hasattr(layer, "azp_adj")
    else:
        assert layer.azp_adj.dtype == torch.int32
        assert layer.azp_adj.tolist() == layer.weight.long().sum(dim=1).tolist()


def test_bf16_weight_quantized_on_load() -> None:
    layer, _, _ = make_layer(FP8, dtype=torch.bfloat16)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.bias.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------ apply


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_apply_matches_float64_oracle(name: str, dtype: torch.dtype) -> None:
    layer, weight, b = make_layer(CONFIGS[name], dtype=dtype, seed=1)
    x = torch.randn(2, 7, 40, generator=torch.Generator().manual_seed(2)).to(dtype)  # leading dims get flattened
    out = layer(x)
    assert out.dtype == dtype and out.shape == (2, 7, 24)
    assert_bf16_close(out, oracle(layer, x))
    # And against the unquantized layer: a few 8-bit steps of relative error at most.
    exact = x.double() @ weight.double().T + b.double()
    rel = (out.double() - exact).norm() / exact.norm()
    assert rel < (0.06 if name == "fp8" else 0.02), f"relative error {rel:.3e}"


def test_apply_without_bias_and_empty_batch() -> None:
    layer, _, _ = make_layer(INT8_ASYM, bias=False)
    x = torch.randn(5, 40)
    assert_bf16_close(layer(x), oracle(layer, x))
    assert layer(torch.empty(0, 40)).shape == (0, 24)


def test_asymmetric_int8_beats_symmetric_on_offset_inputs() -> None:
    """x + 5 in [~2, ~8] leaves the negative half of a symmetric grid unused; a zero point recovers that bit,
    halving the step. Both layers hold the same quantized weights, so the reference with those weights
    isolates the activation error; float16 keeps the GEMM's output rounding (2^-11) out of the way."""
    x = (torch.randn(16, 40, generator=torch.Generator().manual_seed(3)) + 5.0).half()
    errors = {}
    for name in ("int8-sym", "int8-asym"):
        layer, _, _ = make_layer(CONFIGS[name], dtype=torch.float16, seed=4)
        exact = x.double() @ (layer.weight.double() * layer.weight_scale.double()).T + layer.bias.double()
        errors[name] = float((layer(x).double() - exact).norm() / exact.norm())
    assert errors["int8-asym"] < 0.6 * errors["int8-sym"], errors


# ------------------------------------------------------------------------------------------ static scales


def test_static_activations_need_calibrated_scales() -> None:
    for config in (QuantConfig(method="fp8", activation_scheme="static"),
                   QuantConfig(method="int8", activation_scheme="static")):
        with pytest.raises(ConfigError, match="activation_scheme='static'.*calibrated"):
            get_quant_method(config, "model.layers.0.mlp.down_proj")


def qkv_layer(method: W8A8LinearMethod) -> QKVParallelLinear:
    layer = QKVParallelLinear(16, 4, 2, 1, quant_method=method)
    g = torch.Generator().manual_seed(5)
    for sid, rows in (("q", 8), ("k", 4), ("v", 4)):
        layer.weight.weight_loader(layer.weight, torch.randn(rows, 16, generator=g) * 0.1, sid)
    return layer


def test_static_fp8_takes_the_largest_shard_scale() -> None:
    layer = qkv_layer(Fp8LinearMethod(QuantConfig(method="fp8", activation_scheme="static"), calibrated_inputs=True))
    assert layer.input_scale.per_shard and not hasattr(layer, "input_zero_point")
    for sid, scale in zip("qkv", (0.01, 0.03, 0.02)):
        layer.input_scale.weight_loader(layer.input_scale, torch.tensor(scale), sid)
    layer.process_after_loading()
    torch.testing.assert_close(layer.input_scale, torch.tensor([0.03]))
    x = torch.randn(6, 16)
    act = layer.quant_method.quantize_input(layer, x)
    assert act.q.dtype == torch.float8_e4m3fn and act.scale.numel() == 1
    assert_bf16_close(layer(x), oracle(layer, x))


def test_static_asymmetric_int8_covers_every_shard_range() -> None:
    config = QuantConfig(method="int8", activation_scheme="static", symmetric_activations=False)
    layer = qkv_layer(Int8LinearMethod(config, calibrated_inputs=True))
    shards = {"q": (0.02, -100), "k": (0.01, 0), "v": (0.03, -128)}  # (scale, zero point)
    for sid, (scale, zp) in shards.items():
        layer.input_scale.weight_loader(layer.input_scale, torch.tensor(scale), sid)
        layer.input_zero_point.weight_loader(layer.input_zero_point, torch.tensor(zp, dtype=torch.int32), sid)
    layer.process_after_loading()
    scale, zp = float(layer.input_scale), int(layer.input_zero_point)
    lo, hi = scale * (-128 - zp), scale * (127 - zp)
    for s, z in shards.values():
        assert lo <= s * (-128 - z) + scale and hi >= s * (127 - z) - scale
    x = torch.rand(6, 16) * 5.0 - 0.5
    act = layer.quant_method.quantize_input(layer, x)
    assert act.azp is not None and act.azp.numel() == 1
    assert_bf16_close(layer(x), oracle(layer, x))


# ------------------------------------------------------------------------------------------ tiny model

# Cosine-similarity bounds for the last-position logits, derived rather than fitted.
# Rounding to a grid of step s leaves an error uniform in +-s/2 (rms s/sqrt(12)). Per-channel / per-token
# INT8 maps each row's absmax to 127, so an element's error is ~1/254 of the absmax, i.e. relative to the
# row's rms: ABSMAX_OVER_RMS / (254 sqrt(3)); rows of 40..128 roughly Gaussian values have absmax ~2.5-3 rms.
# E4M3 keeps 3 mantissa bits: relative error up to 2^-4, rms at most 2^-4 / sqrt(3).
# A GEMM output sums K products whose weight and activation errors are independent, so its relative error
# has rms sqrt(2) e. Each decoder layer has 4 GEMMs (qkv, o, gate_up, down); if their errors add in
# quadrature into the final hidden state, delta^2 = 2 e^2 * 4 * num_layers, and for a small error orthogonal
# to the logits 1 - cos = delta^2 / 2. The residual stream (which carries the exact embeddings) and the norms
# only damp this, so the estimate is an upper bound; the GEMM's bf16 output rounding (rms ~2^-8/sqrt(3) per
# element) adds a few percent to delta^2 and is covered by that slack.
# Measured (tiny = 2 layers, seed 1, 8 prompts, float32, min over prompts), bounds 0.98958 (fp8), 0.99963 (int8):
#   llama: fp8 0.99891, int8-sym 0.99995, int8-asym 0.99995;  qwen2: fp8 0.99788, int8-sym 0.99994, int8-asym 0.99993
# i.e. 5-10x margin in 1 - cos, while a wrong scale, a missing zero-point correction or a transposed weight
# drives the cosine below 0.9 (dropping the azp term gave 0.66). On an H200 with the Triton kernels the 4-layer
# "small" llama gave fp8 0.9950, int8 0.9997 against bounds 0.979 and 0.9993.
ABSMAX_OVER_RMS = 3.0
REL_RMS = {"fp8": 2.0**-4 / math.sqrt(3), "int8": ABSMAX_OVER_RMS / (254 * math.sqrt(3))}
GEMMS_PER_LAYER = 4
BLOCK_SIZE = 16
PROMPT_LENS = [1, 5, 17, 33, 40, 9, 24, 3]


def cosine_bound(method: str, num_layers: int) -> float:
    delta_sq = 2 * REL_RMS[method] ** 2 * GEMMS_PER_LAYER * num_layers
    return 1.0 - delta_sq / 2


def last_logits(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    """One flat prefill of every prompt over a paged KV cache; the logits of each prompt's last token."""
    device = model.lm_head.weight.device
    per_seq = max(-(-len(p) // BLOCK_SIZE) for p in prompts)
    num_blocks = len(prompts) * per_seq + 1
    for layer in model.attention_layers():
        layer.bind_kv_cache(torch.zeros(2, num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_size,
                                        dtype=model.dtype, device=device))
    block_tables = torch.arange(1, num_blocks, dtype=torch.int32).view(len(prompts), per_seq)
    input_ids, positions, slots = [], [], []
    for s, prompt in enumerate(prompts):
        input_ids += prompt
        positions += range(len(prompt))
        slots += [int(block_tables[s, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(len(prompt))]
    lens = torch.tensor([len(p) for p in prompts])
    ends = lens.cumsum(0)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(device, torch.int32),
        seq_lens=lens.to(device, torch.int32),
        block_tables=block_tables.to(device),
        max_query_len=int(lens.max()),
        max_seq_len=int(lens.max()),
    )
    with torch.no_grad():
        hidden = model(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), metadata)
        return model.compute_logits(hidden[ends.to(device) - 1]).cpu()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory) -> tuple[Path, list[list[int]], torch.Tensor]:
    """A checkpoint (qwen2 adds q/k/v bias and tied embeddings), prompts and the unquantized logits."""
    path = tmp_path_factory.mktemp(request.param)
    write_tiny_checkpoint(path, arch=request.param, seed=1)
    reference = load_model(ModelConfig(model=str(path), dtype="float32"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, reference.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return path, prompts, last_logits(reference, prompts)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_quantized_logits_stay_close(tiny, name: str) -> None:
    path, prompts, reference = tiny
    config = CONFIGS[name]
    model = load_model(ModelConfig(model=str(path), dtype="float32"), config)
    quant_dtype = torch.float8_e4m3fn if config.method == "fp8" else torch.int8
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == GEMMS_PER_LAYER * model.config.num_layers
    assert all(m.weight.dtype == quant_dtype for m in linears)
    # Embeddings and LM head stay in the model dtype.
    assert model.model.embed_tokens.weight.dtype == model.lm_head.weight.dtype == torch.float32
    cos = F.cosine_similarity(last_logits(model, prompts).double(), reference.double(), dim=-1)
    bound = cosine_bound(config.method, model.config.num_layers)
    assert cos.min() >= bound, f"min cosine {cos.min():.6f} < bound {bound:.6f} ({cos.tolist()})"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_runs_the_quantized_model(tiny, name: str) -> None:
    """The engine path: its first greedy token is the argmax of the quantized model's own logits."""
    path, prompts, _ = tiny
    config = CONFIGS[name]
    llm = LLM(str(path), dtype="float32", max_model_len=64, quantization=config.method,
              symmetric_activations=config.symmetric_activations)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    direct = last_logits(llm.runner.model, prompts).argmax(dim=-1).tolist()
    assert [o.outputs[0].token_ids[0] for o in outputs] == direct


@pytest.mark.parametrize("name", ["fp8", "int8-asym"])
def test_generate_bfloat16(tmp_path: Path, name: str) -> None:
    """bf16 models hand the GEMM their own dtype, with no widening step."""
    write_tiny_checkpoint(tmp_path, arch="llama", seed=2)
    config = CONFIGS[name]
    llm = LLM(str(tmp_path), dtype="bfloat16", max_model_len=64, quantization=config.method,
              symmetric_activations=config.symmetric_activations)
    outputs = llm.generate([{"prompt_token_ids": p} for p in ([5, 6, 7], [9] * 20)],
                           SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3]
    layer = llm.runner.model.model.layers[0].mlp.down_proj
    assert layer(torch.randn(2, layer.input_size, dtype=torch.bfloat16)).dtype == torch.bfloat16
