"""Tiny random checkpoints written by transformers itself for the pooling tests: sequence classifiers
(cross-encoders) of the Llama, Qwen2 and Qwen3 families, and a causal LM laid out as a sentence-transformers
embedding model (`modules.json`, `1_Pooling/config.json`, a `Normalize` module)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from kestrel.loader.tokenizer_init import write_tokenizer

_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 512, "torch_dtype": "float32"}
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),
}


def _config(family: str, vocab_size: int, **extra: object) -> transformers.PretrainedConfig:
    config_cls, family_extra = FAMILIES[family]
    return config_cls(vocab_size=vocab_size, **_SHAPE, **family_extra, bos_token_id=1, eos_token_id=2,
                      pad_token_id=None, tie_word_embeddings=False, **extra)


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights large enough that every layer matters (transformers initialises norms to one)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model.eval()


def write_classifier(path: Path, family: str, num_labels: int = 1, seed: int = 0) -> Path:
    """`<Family>ForSequenceClassification` with a `score` head of `num_labels` outputs, and the built-in tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(str(path))
    cls = {"llama": transformers.LlamaForSequenceClassification, "qwen2": transformers.Qwen2ForSequenceClassification,
           "qwen3": transformers.Qwen3ForSequenceClassification}[family]
    torch.manual_seed(seed)
    model = cls(_config(family, vocab_size, num_labels=num_labels))
    _perturbed(model, seed).save_pretrained(str(path))
    return path


def write_sentence_transformer(path: Path, family: str, pooling_mode: str, normalize: bool, seed: int = 0) -> Path:
    """A causal LM with sentence-transformers' files: `pooling_mode` is the Pooling config's key set to true
    (`pooling_mode_mean_tokens`, `pooling_mode_lasttoken`, `pooling_mode_cls_token`)."""
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(str(path))
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}[family]
    torch.manual_seed(seed)
    _perturbed(cls(_config(family, vocab_size)), seed).save_pretrained(str(path))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = ["pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
             "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken"]
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": _SHAPE["hidden_size"], **{m: m == pooling_mode for m in modes}}))
    return path
