"""`kestrel.quant.gguf_export`: real weights written as GGUF. Its Q4_K blocks read back by gguf's own dequantizer
within the error of 4-bit codes on each 32-value sub-block's range (the scales' 6-bit rounding included), rows
that K-quant blocks cannot hold in llama.cpp's fallback type, and a tiny Llama written in Q4_K and Q8_0 from its
checkpoint: kestrel's float32 logits match transformers holding gguf's dequantization of the file, which stays
within the quantization error of the original weights; the quant sweep's GGUF variants and its --variants refusal."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_gguf import assert_matches, load_gguf, oracle, tiny_hf

from kestrel.bench import ppl
from kestrel.bench.quant_accuracy import run_sweep, selected_variants, write_gguf_variant
from kestrel.config import ConfigError
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.quant import gguf_export

gguf = pytest.importorskip("gguf")


def test_q4_k_blocks_read_back_within_their_step():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 768)) * 0.05).astype(np.float32)
    x[0, :32] = np.abs(x[0, :32]) + 0.3  # a sub-block of positive values only: its min is 0
    x[1, 256:512] = 0.0  # an all-zero super-block
    x[2, :64] *= 40.0  # one large sub-block beside small ones: the 6-bit scales' range
    blocks = gguf_export.quantize_q4_k(x)
    assert blocks.dtype == np.uint8 and blocks.shape == (6, 768 // 256 * 144)
    y = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)
    sub = x.reshape(6, -1, 32)
    lo, hi = np.minimum(sub.min(axis=2), 0.0), sub.max(axis=2)
    d = ((hi - lo) / 15.0).reshape(6, 3, 8).max(axis=2) / 63.0  # each super-block's scale step
    dmin = (-lo).reshape(6, 3, 8).max(axis=2) / 63.0
    # half a code step, plus the rounded scale's drift over 15 codes and the rounded min
    bound = (hi - lo) / 30.0 + (8 * np.repeat(d, 8, axis=1) + np.repeat(dmin, 8, axis=1) / 2) * 1.01 + 1e-6
    err = np.abs(y.reshape(6, -1, 32) - sub).max(axis=2)
    assert bool((err <= bound).all()), (err / bound).max()
    assert not y[1, 256:512].any()


def test_rows_k_quant_blocks_cannot_hold_take_the_fallback_type():
    assert gguf_export.stored_type("Q4_K", 640) == "Q5_0"
    assert gguf_export.stored_type("Q4_K", 512) == "Q4_K"
    assert gguf_export.stored_type("Q8_0", 640) == "Q8_0"
    assert gguf_export.stored_type("Q4_K", 100) == "F16"  # no Q5_0 block of 32 divides it either
    with pytest.raises(ValueError, match="GGML type Q6_K is not written here; supported: F32, F16"):
        gguf_export.encode(np.zeros((1, 256), dtype=np.float32), "Q6_K")


def test_the_token_list_is_padded_to_the_embedding_and_eos_lists_and_bos_follow_the_checkpoint(tmp_path):
    hf_dir = tmp_path / "hf"
    config = write_tiny_checkpoint(hf_dir, "qwen3", hidden_size=256, intermediate_size=512, head_dim=64)
    tokens = len(json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"])
    config.update(vocab_size=tokens + 64, eos_token_id=[config["eos_token_id"], 3])
    (hf_dir / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    tok_config["add_bos_token"] = False
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tok_config))
    weights = {n: t.float().numpy() for n, t in load_file(str(hf_dir / "model.safetensors")).items()}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            weights[name] = np.concatenate([weights[name], np.zeros((64, weights[name].shape[1]), np.float32)])
    path = gguf_export.write_gguf(tmp_path / "m.gguf", hf_dir, weights.items(), lambda name: "Q8_0")
    fields = gguf.GGUFReader(str(path)).fields
    assert len(fields["tokenizer.ggml.tokens"].data) == tokens + 64
    assert int(fields["tokenizer.ggml.eos_token_id"].parts[-1][0]) == config["eos_token_id"][0]
    assert not bool(fields["tokenizer.ggml.add_bos_token"].parts[-1][0])
    model = load_gguf(path)
    assert model.config.vocab_size == tokens + 64


@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0"])
def test_a_checkpoint_written_as_gguf_matches_its_dequantization(type_name, tmp_path):
    hf_dir = tmp_path / "hf"  # tiny_hf's shape, but down_proj's rows 640 long: Q4_K's fallback
    config = write_tiny_checkpoint(hf_dir, "llama", hidden_size=256, intermediate_size=640, rope_scaling=None)
    weights = load_file(str(hf_dir / "model.safetensors"))
    path = gguf_export.write_gguf(tmp_path / "model.gguf", hf_dir,
                                  ((n, t.float().numpy()) for n, t in weights.items()), lambda name: type_name)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.attn_q.weight"] == type_name
    assert types["blk.0.ffn_down.weight"] == ("Q5_0" if type_name == "Q4_K" else type_name)
    dequantized = gguf_export.dequantized_tensors([path], config)
    assert set(dequantized) == set(weights)
    for name, values in dequantized.items():  # q/k rows back in Hugging Face's order, values near the originals
        original = weights[name].float()
        rel = (torch.from_numpy(values) - original).norm() / original.norm()
        assert rel <= (0.12 if type_name == "Q4_K" else 0.01), (name, rel)
    assert_matches(load_gguf(path), oracle(hf_dir, [path], config), config["vocab_size"])


def test_the_sweep_writes_a_gguf_file_and_its_dequantized_float_model(tmp_path):
    hf_dir, config = tiny_hf(tmp_path / "hf", "llama")
    path = write_gguf_variant(hf_dir, tmp_path / "q8", "Q8_0", dequantized=True)
    assert path == tmp_path / "q8" and (tmp_path / "q8.gguf").is_file()
    assert json.loads((path / "config.json").read_text()) == config
    float_weights = load_file(str(path / "model.safetensors"))
    for name, values in gguf_export.dequantized_tensors([tmp_path / "q8.gguf"], config).items():
        assert torch.equal(float_weights[name], torch.from_numpy(values))


def test_variants_without_the_sweep_and_unknown_variants_are_refused(capsys):
    assert ppl.main(["--variants", "gguf-q8_0"]) != 0
    assert "--variants selects the variants of --quant-sweep" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--variants: unknown gguf-q3; expected some of float, "):
        run_sweep(argparse.Namespace(variants="gguf-q3,gguf-q8_0"), None, None)
    with pytest.raises(ConfigError, match="--variants ' , ' names no variant"):
        selected_variants(" , ")
    assert selected_variants("gguf-q8_0, gguf-q4_k") == {"float", "gguf-q8_0", "gguf-q4_k"}
    assert ppl.main(["--quant-sweep", "--variants", "nope"]) != 0
    assert "--variants: unknown nope" in capsys.readouterr().err
