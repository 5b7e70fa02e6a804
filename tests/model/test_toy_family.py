"""A new family in one file: a Llama variant with a GELU-tanh gated MLP and per-head q/k RMSNorm, built from the
shared blocks, registered by name, loaded from a checkpoint, and checked against a hand-written float64 forward."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kestrel.config import ModelConfig
from kestrel.loader import load_model
from kestrel.loader.model_init import checkpoint_shapes
from kestrel.model.arch import DecoderArch
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.base import DecoderForCausalLM
from kestrel.model.registry import register_model


class ToyForCausalLM(DecoderForCausalLM):
    """The whole family: its config reading."""

    @classmethod
    def arch_config(cls, hf: dict) -> DecoderArch:
        return DecoderArch.from_hf(hf, activation="gelu_tanh", qk_norm=True)


CONFIG = {"architectures": ["ToyForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128, "torch_dtype": "float32"}
BLOCK = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    register_model("ToyForCausalLM", ToyForCausalLM)
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=g) * (0.3 if "norm" in name else 0.08) + ("norm" in name)
               for name, shape in checkpoint_shapes(CONFIG).items()}
    path = tmp_path_factory.mktemp("toy")
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(__import__("json").dumps(CONFIG))
    return path, tensors


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CONFIG["rms_norm_eps"]) * w


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    inv_freq = 1.0 / CONFIG["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions[:, None, None].double() * inv_freq
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()), dim=-1)


def reference_logits(w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The toy model written out by hand, in float64, over one whole sequence."""
    w = {k: v.double() for k, v in w.items()}
    heads, kv_heads, d = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["head_dim"]
    n = len(ids)
    pos = torch.arange(n)
    h = w["model.embed_tokens.weight"][ids]
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, d)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, d)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, d)
        q = rope(rms(q, w[p + "self_attn.q_norm.weight"]), pos)
        k = rope(rms(k, w[p + "self_attn.k_norm.weight"]), pos).repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (F.gelu(gate, approximate="tanh") * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


def kestrel_logits(model: torch.nn.Module, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """The sequence run in prefill chunks over a paged cache (blocks in reverse order), logits of every row."""
    num_blocks = -(-len(ids) // BLOCK)
    for layer in model.attention_layers():
        layer.bind_kv_cache(torch.zeros(2, num_blocks + 1, BLOCK, layer.num_kv_heads, layer.head_size))
    table = torch.arange(num_blocks, 0, -1, dtype=torch.int32).view(1, -1)
    out, start = [], 0
    for size in chunks:
        end = start + size
        pos = torch.arange(start, end)
        meta = AttentionMetadata(slot_mapping=(table[0, pos // BLOCK] * BLOCK + pos % BLOCK).long(),
                                 query_start_loc=torch.tensor([0, size], dtype=torch.int32),
                                 seq_lens=torch.tensor([end], dtype=torch.int32), block_tables=table,
                                 max_query_len=size, max_seq_len=end)
        with torch.no_grad():
            out.append(model.compute_logits(model(torch.tensor(ids[start:end]), pos, meta)))
        start = end
    return torch.cat(out)


def test_toy_family_matches_its_reference(checkpoint) -> None:
    path, tensors = checkpoint
    model = load_model(ModelConfig(model=str(path), dtype="float32"))
    assert type(model) is ToyForCausalLM
    ids = torch.randint(0, CONFIG["vocab_size"], (21,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = kestrel_logits(model, ids, [13, 5, 1, 1, 1])
    expected = reference_logits(tensors, ids).float()
    assert (ours - expected).abs().max().item() < 1e-4 * expected.abs().max().item()
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_reference_is_sensitive_to_the_variation(checkpoint) -> None:
    """The check can fail: the same weights run as plain Llama (SiLU, no q/k norm) differ from the reference."""
    path, tensors = checkpoint
    model = load_model(ModelConfig(model=str(path), dtype="float32"))
    for layer in model.decoder_layers():
        layer.mlp.act_fn.activation = "silu"
    ids = list(range(10))
    diff = (kestrel_logits(model, ids, [10]) - reference_logits(tensors, ids).float()).abs().max().item()
    assert diff > 1e-2
