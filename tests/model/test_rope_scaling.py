"""Rope scaling types (linear, llama3, dynamic, yarn, longrope) against Hugging Face transformers.

Frequencies and attention factors are compared with transformers' `ROPE_INIT_FUNCTIONS` for the length the
engine serves (`max_position`); logits of tiny random checkpoints written by transformers itself are compared
with the transformers model on a flat batch (float32).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from test_hf_parity import PagedBatch, assert_rel_close, hf_logits, load, random_prompts

from kestrel.config import ConfigError
from kestrel.model.layers.rotary import (
    SUPPORTED_ROPE_TYPES,
    RopeConfig,
    RotaryEmbedding,
    compute_attention_factor,
    compute_inv_freq,
)
from kestrel.model.registry import get_model_class

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
WIDE_HEADS = {**TINY, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}  # head_dim 128


def factors(n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return [round(1.0 + 3.0 * x, 4) for x in torch.rand(n, generator=g).tolist()]


SHORT, LONG = factors(8, 1), factors(8, 2)


@dataclass
class Case:
    config_cls: str
    config: dict[str, Any]
    seq_lens: list[int] = field(default_factory=lambda: [64])


FREQ_CASES = {
    "linear": Case("LlamaConfig", {**TINY, "rope_scaling": {"type": "linear", "factor": 2.0}}),
    "llama3": Case("LlamaConfig", {**TINY, "max_position_embeddings": 512, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 500000.0}}),
    "dynamic-partial": Case("LlamaConfig", {**TINY, "max_position_embeddings": 64, "partial_rotary_factor": 0.5,
                                            "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                                "rope_theta": 500.0}},
                            [16, 64, 65, 100, 1000]),
    "dynamic-legacy-type": Case("Qwen2Config", {**TINY, "max_position_embeddings": 64, "rope_theta": 1e6,
                                                "rope_scaling": {"type": "dynamic", "factor": 4.0}}, [64, 200]),
    "yarn": Case("LlamaConfig", {**TINY, "max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}}),
    "yarn-qwen2.5": Case("Qwen2Config", {**WIDE_HEADS, "max_position_embeddings": 131072, "rope_theta": 1e6,
                                         "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 32768}}, [128]),
    "yarn-betas-untruncated-partial": Case("LlamaConfig", {
        **WIDE_HEADS, "max_position_embeddings": 32768, "partial_rotary_factor": 0.5,
        "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                            "beta_fast": 16, "beta_slow": 2, "truncate": False, "rope_theta": 10000.0}}),
    "yarn-mscale": Case("LlamaConfig", {**WIDE_HEADS, "max_position_embeddings": 163840, "rope_parameters": {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
        "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}}),
    "yarn-attention-factor": Case("LlamaConfig", {**TINY, "max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "attention_factor": 1.25,
        "rope_theta": 10000.0}}),
    "yarn-null-factor": Case("LlamaConfig", {**TINY, "max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 16, "rope_theta": 10000.0}}),
    "longrope-phi3": Case("Phi3Config", {**TINY, "max_position_embeddings": 64,
                                         "original_max_position_embeddings": 16, "rope_parameters": {
                                             "rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}},
                          [8, 16, 17, 64]),
    "longrope-phi4-mini-partial": Case("Phi3Config", {
        **TINY, "max_position_embeddings": 64, "original_max_position_embeddings": 16,
        "partial_rotary_factor": 0.75, "rope_parameters": {"rope_type": "longrope", "short_factor": SHORT[:6],
                                                           "long_factor": LONG[:6]}}, [16, 17]),
    "longrope-su": Case("Phi3Config", {**TINY, "max_position_embeddings": 64, "original_max_position_embeddings": 16,
                                       "rope_scaling": {"type": "su", "short_factor": SHORT, "long_factor": LONG,
                                                        "original_max_position_embeddings": 16}}, [16, 17]),
    "longrope-phi3-legacy-yarn": Case("Phi3Config", {
        **TINY, "max_position_embeddings": 64, "original_max_position_embeddings": 16,
        "rope_scaling": {"type": "yarn", "short_factor": SHORT, "long_factor": LONG,
                         "original_max_position_embeddings": 16}}, [16, 17]),
    "longrope-attention-factor": Case("Phi3Config", {
        **TINY, "max_position_embeddings": 64, "original_max_position_embeddings": 16, "rope_parameters": {
            "rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "attention_factor": 1.1}},
        [16, 17]),
    "longrope-llama-factor": Case("LlamaConfig", {**TINY, "max_position_embeddings": 16, "rope_parameters": {
        "rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 10000.0}}, [16, 64]),
}


def hf_config_of(case: Case):
    return getattr(transformers, case.config_cls)(**copy.deepcopy(case.config))


def config_json(case: Case) -> dict[str, Any]:
    """The case's config as a config.json would hold it."""
    return {"model_type": getattr(transformers, case.config_cls).model_type, **copy.deepcopy(case.config)}


@pytest.mark.parametrize("name", list(FREQ_CASES))
def test_frequencies_and_attention_factor_match_transformers(name: str) -> None:
    case = FREQ_CASES[name]
    hf_config = hf_config_of(case)
    rope_type = hf_config.rope_parameters["rope_type"]
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    # config.json as written (transformers 4 layout or not), and as transformers 5 writes it back
    for layout in (config_json(case), hf_config.to_dict()):
        rope = RopeConfig.from_hf(layout)
        assert rope.rope_type == rope_type
        for seq_len in case.seq_lens:
            expected, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=seq_len)
            rotary = RotaryEmbedding(head_dim, seq_len, rope)
            assert rotary.rotary_dim == expected.numel() * 2
            torch.testing.assert_close(compute_inv_freq(rotary.rotary_dim, rope, seq_len), expected,
                                       rtol=1e-6, atol=0)
            assert compute_attention_factor(rope) == pytest.approx(attention_factor, rel=1e-12)
            angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), expected)
            torch.testing.assert_close(rotary.cos_cache, angles.cos() * attention_factor)
            torch.testing.assert_close(rotary.sin_cache, angles.sin() * attention_factor)


def test_scaling_is_not_a_no_op() -> None:
    """Guards the comparisons above: each type's frequencies (or factor) differ from the default rope's."""
    default = compute_inv_freq(16, RopeConfig(), 64)
    seen = set()
    for name, case in FREQ_CASES.items():
        rope = RopeConfig.from_hf(config_json(case))
        head_dim = case.config["hidden_size"] // case.config["num_attention_heads"]
        if rope.theta != 10000.0 or head_dim != 16 or rope.partial_rotary_factor != 1.0:
            continue
        inv_freq = compute_inv_freq(16, rope, max(case.seq_lens))
        assert not torch.allclose(inv_freq, default) or compute_attention_factor(rope) != 1.0, name
        seen.add(rope.rope_type)
    assert seen == {"linear", "yarn", "longrope"}
    dynamic = RopeConfig.from_hf(FREQ_CASES["dynamic-partial"].config)
    assert torch.equal(compute_inv_freq(8, dynamic, 64), compute_inv_freq(8, RopeConfig(theta=500.0), 64))
    assert not torch.allclose(compute_inv_freq(8, dynamic, 65), compute_inv_freq(8, dynamic, 64))


def test_longrope_factors_follow_the_served_length() -> None:
    rope = RopeConfig.from_hf(FREQ_CASES["longrope-phi3"].config)
    base = compute_inv_freq(16, RopeConfig(), 16)
    torch.testing.assert_close(compute_inv_freq(16, rope, 16), base / torch.tensor(SHORT))
    torch.testing.assert_close(compute_inv_freq(16, rope, 17), base / torch.tensor(LONG))
    # the attention factor is the config's, whatever the served length: sqrt(1 + ln(64 / 16) / ln(16))
    assert RotaryEmbedding(16, 16, rope).attention_factor == pytest.approx(1.5 ** 0.5)


def test_top_level_original_length_wins() -> None:
    """Phi-3 configs keep the pretraining length at the top level; transformers prefers it to the dict's."""
    hf = {"max_position_embeddings": 64, "original_max_position_embeddings": 16,
          "rope_scaling": {"type": "su", "short_factor": SHORT, "long_factor": LONG,
                           "original_max_position_embeddings": 32}}
    rope = RopeConfig.from_hf(hf)
    assert (rope.rope_type, rope.original_length()) == ("longrope", 16)
    del hf["original_max_position_embeddings"]
    assert RopeConfig.from_hf(hf).original_length() == 32
    del hf["rope_scaling"]["original_max_position_embeddings"]
    assert RopeConfig.from_hf(hf).original_length() == 64


@pytest.mark.parametrize("hf, match", [
    ({"rope_scaling": {"type": "foo", "factor": 2.0}}, r"rope_scaling\.type='foo'.*supported.*'yarn'.*'longrope'"),
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, r"rope_type='proportional'.*supported"),
    ({"max_position_embeddings": 64, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 16}},
     r"rope_scaling: rope type 'yarn' needs 'factor'"),
    ({"rope_scaling": {"type": "dynamic"}}, r"rope type 'dynamic' needs 'factor'"),
    ({"rope_scaling": {"type": "linear", "factor": None}}, r"rope_scaling\.factor=None"),
    ({"rope_scaling": {"type": "linear", "factor": "2"}}, r"rope_scaling\.factor='2': expected a positive number"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, r"needs 'original_max_position_embeddings'"),
    ({"max_position_embeddings": 64, "rope_parameters": {"rope_type": "longrope", "short_factor": SHORT}},
     r"rope_parameters: rope type 'longrope' needs 'long_factor'"),
    ({"max_position_embeddings": 64, "rope_parameters": {"rope_type": "longrope", "short_factor": "1",
                                                         "long_factor": LONG}},
     r"rope_parameters\.short_factor='1': expected a list of numbers"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}},
     r"per-layer-type rope parameters are not supported"),
])
def test_bad_rope_config_is_a_config_error(hf: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RopeConfig.from_hf(hf)


def test_longrope_factors_must_fit_the_rotary_dim() -> None:
    rope = RopeConfig.from_hf({"max_position_embeddings": 64, "original_max_position_embeddings": 16,
                               "rope_parameters": {"rope_type": "longrope", "short_factor": SHORT[:7],
                                                   "long_factor": LONG[:7]}})
    with pytest.raises(ConfigError, match=r"short_factor: 7 values; the rotary dim is 16.*needs 8"):
        RotaryEmbedding(16, 64, rope)
    with pytest.raises(ConfigError, match=r"needs 6"):
        RotaryEmbedding(16, 64, RopeConfig.from_hf({**TINY, "partial_rotary_factor": 0.75,
                                                    "rope_scaling": rope.params | {"type": "longrope"}}))


def test_supported_types_are_transformers_scaling_types() -> None:
    assert set(SUPPORTED_ROPE_TYPES) - {"default"} <= set(ROPE_INIT_FUNCTIONS)


# ---------------------------------------------------------------------------------------------- end to end

PROMPT_LENS = [5, 29, 12, 1, 40]


@dataclass
class Model:
    family: str  # transformers' class prefix: Llama, Phi3
    config: dict[str, Any]
    prompt_lens: list[int] = field(default_factory=lambda: PROMPT_LENS)


E2E_CASES = {
    "llama-yarn": Model("Llama", {"max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}}),
    "llama-dynamic": Model("Llama", {"max_position_embeddings": 48, "rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    # served length 64 = original: the short factors; the attention factor from `factor`
    "llama-longrope-short": Model("Llama", {"max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0}}),
    # served length 64 > original 16: the long factors, so every prompt is longer than 16 (as transformers
    # switches per forward); the attention factor from 64 / 16
    "llama-longrope-long": Model("Llama", {"max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
        "original_max_position_embeddings": 16, "rope_theta": 10000.0}}, [17, 40, 29, 60]),
    "phi3-longrope-short": Model("Phi3", {"max_position_embeddings": 64, "original_max_position_embeddings": 64,
                                          "rope_parameters": {"rope_type": "longrope", "short_factor": SHORT,
                                                              "long_factor": LONG, "factor": 4.0}}),
    "phi3-longrope-long": Model("Phi3", {"max_position_embeddings": 64, "original_max_position_embeddings": 16,
                                         "rope_parameters": {"rope_type": "longrope", "short_factor": SHORT,
                                                             "long_factor": LONG}}, [17, 40, 29, 60]),
}


def write_hf_checkpoint(path: Path, family: str, config: dict[str, Any]):
    """A tiny random checkpoint saved by transformers; returns the transformers model read back from it."""
    hf_config = getattr(transformers, f"{family}Config")(
        **TINY, **copy.deepcopy(config), initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=None)
    torch.manual_seed(0)
    getattr(transformers, f"{family}ForCausalLM")(hf_config).save_pretrained(str(path))
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager",
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(E2E_CASES))
def pair(request, tmp_path_factory):
    case = E2E_CASES[request.param]
    try:
        get_model_class(f"{case.family}ForCausalLM")
    except ConfigError:
        pytest.skip(f"{case.family}ForCausalLM is not a registered architecture")
    path = tmp_path_factory.mktemp(request.param)
    hf_model = write_hf_checkpoint(path, case.family, case.config)
    return case, path, load(path), hf_model


def flat_batch_logits(model: torch.nn.Module, prompts: list[list[int]]) -> list[torch.Tensor]:
    return PagedBatch(model, len(prompts)).step(prompts, [(0, len(p)) for p in prompts])


def test_flat_batch_logits_match_hf(pair) -> None:
    case, path, model, hf_model = pair
    prompts = random_prompts(TINY["vocab_size"], case.prompt_lens)
    expected = [hf_logits(hf_model, tokens) for tokens in prompts]
    for ours, ref in zip(flat_batch_logits(model, prompts), expected):
        assert_rel_close(ours, ref)
    if case.config["rope_parameters"]["rope_type"] == "dynamic":
        return  # within max_position_embeddings dynamic is the default rope; see the next test
    # the scaling matters here: the default rope misses the reference by far
    default = {"rope_type": "default", "rope_theta": 10000.0}
    unscaled = load(path, hf_overrides={"rope_scaling": None, "rope_parameters": default})
    worst = max(float((ours - ref).abs().max() / ref.abs().max())
                for ours, ref in zip(flat_batch_logits(unscaled, prompts), expected))
    assert worst > 100 * 1e-4


def test_dynamic_ntk_past_max_position_embeddings_matches_hf(tmp_path: Path) -> None:
    """Served past max_position_embeddings (48 -> 60), dynamic NTK rescales its base for the served length; so
    does transformers for a sequence of that length. (kestrel caps max_model_len at max_position_embeddings;
    the served length is set on the table here.)"""
    hf_model = write_hf_checkpoint(tmp_path, "Llama", E2E_CASES["llama-dynamic"].config)
    model = load(tmp_path)
    rope = RopeConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    tables = {id(m): m for m in model.modules() if isinstance(m, RotaryEmbedding)}
    assert len(tables) == 1
    rotary = next(iter(tables.values()))
    served = RotaryEmbedding(rotary.head_size, 60, rope)
    rotary.cos_cache, rotary.sin_cache, rotary.max_position = served.cos_cache, served.sin_cache, 60
    prompts = random_prompts(TINY["vocab_size"], [60, 60], seed=3)
    for ours, tokens in zip(flat_batch_logits(model, prompts), prompts):
        assert_rel_close(ours, hf_logits(hf_model, tokens))
    assert not torch.allclose(served.cos_cache[:48], RotaryEmbedding(rotary.head_size, 48, rope).cos_cache)


def test_tables_on_the_meta_device_are_sized_but_not_computed() -> None:
    """A memory plan's model (built on the meta device) gets cos and sin tables of the real ones' size, as two
    tensors (the plan counts each), while the rope config is still checked."""
    rope = RopeConfig.from_hf({**TINY, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 32}})
    real = RotaryEmbedding(16, 64, rope)
    with torch.device("meta"):
        meta = RotaryEmbedding(16, 64, rope)
    for name in ("cos_cache", "sin_cache"):
        ours, theirs = getattr(meta, name), getattr(real, name)
        assert ours.device.type == "meta" and (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype)
    assert len(dict(meta.named_buffers())) == 2
    bad = RopeConfig.from_hf({"max_position_embeddings": 64, "original_max_position_embeddings": 16,
                              "rope_parameters": {"rope_type": "longrope", "short_factor": SHORT[:7],
                                                  "long_factor": LONG[:7]}})
    with torch.device("meta"), pytest.raises(ConfigError, match="needs 8"):
        RotaryEmbedding(16, 64, bad)


def test_a_meta_device_model_imports_no_symbolic_shapes() -> None:
    """Computed on the meta device, the tables' first `arange` imported sympy and torch's symbolic shapes: seconds
    of every engine's start-up. A fresh process, since this one may have imported them already."""
    code = ("import sys, torch\n"
            "from kestrel.model.layers.rotary import RopeConfig, RotaryEmbedding\n"
            "with torch.device('meta'):\n"
            "    RotaryEmbedding(64, 4096, RopeConfig())\n"
            "print(sorted(m for m in ('sympy', 'torch._dynamo') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
