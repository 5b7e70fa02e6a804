"""The kestrel-tiny network for training: a Llama decoder (GQA, RoPE, SwiGLU, RMSNorm) in plain PyTorch.

Parameter names, the RoPE convention (rotate-half) and the norm arithmetic are those of Hugging Face's
`LlamaForCausalLM`, so `state_dict()` is the checkpoint: no renaming, no permutation. Dropout exists
only here (training regularizer); the saved model has none.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 640
    num_layers: int = 7
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def hf_config(self, bos_token_id: int, eos_token_id: int, dtype: str) -> dict:
        """config.json for transformers' LlamaForCausalLM (and kestrel's loader)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.init_std,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "torch_dtype": dtype,
            "use_cache": True,
        }


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As in HF: normalize in fp32, cast back, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(cfg: TinyConfig, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim))
    freqs = torch.outer(torch.arange(length, device=device).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_proj(x).view(b, t, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # enable_gqa maps query head h to kv head h // (heads / kv_heads), HF's repeat_kv grouping.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dropout: float) -> torch.Tensor:
        x = x + F.dropout(self.self_attn(self.input_layernorm(x), cos, sin), dropout, self.training)
        return x + F.dropout(self.mlp(self.post_attention_layernorm(x)), dropout, self.training)


class Backbone(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TinyLlama(nn.Module):
    """`model.*` and `lm_head` mirror LlamaForCausalLM's module tree, so state_dict keys are HF's."""

    def __init__(self, cfg: TinyConfig, dropout: float = 0.0) -> None:
        super().__init__()
        self.cfg = cfg
        self.dropout = dropout
        self.model = Backbone(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: residual-branch outputs scaled down by depth so the stream's variance stays put.
        residual_std = self.cfg.init_std / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else self.cfg.init_std
            nn.init.normal_(p, mean=0.0, std=std)

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, time, vocab]."""
        t = input_ids.shape[1]
        cos, sin = rope_tables(self.cfg, t, input_ids.device)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, self.dropout)
        return F.linear(self.model.norm(x), self.head_weight())

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(input_ids)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


_SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def save_hf_model(model: TinyLlama, out: str | Path, bos_token_id: int, eos_token_id: int,
                  dtype: str = "bfloat16") -> int:
    """Write config.json, generation_config.json and model.safetensors; return the safetensors size in bytes.

    The weights file is written under a temporary name and renamed, so a run cut short mid-write
    leaves the previous good file in place.
    """
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", _SAVE_DTYPES[dtype]).contiguous() for name, t in model.state_dict().items()}
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / "model.safetensors")
    _write_json(path / "config.json", model.cfg.hf_config(bos_token_id, eos_token_id, dtype))
    _write_json(path / "generation_config.json", {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id})
    return (path / "model.safetensors").stat().st_size


def config_dict(cfg: TinyConfig) -> dict:
    return asdict(cfg)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
