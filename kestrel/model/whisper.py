"""Whisper (`WhisperForConditionalGeneration`), the encoder-decoder case: the shared Whisper audio encoder
(`layers/audio.py`, no pooling, every clip padded to the feature extractor's 30 s window and attended whole, as the
checkpoint was trained) and a decoder of pre-norm layers with learned absolute positions, causal self-attention on
the paged KV cache, and cross-attention over the encoder output.

A request's clip is its one media item, its range spanning the decoder prompt (so prefix-cache hashes carry the
clip). The encoder runs once per request, through the runner's encoder step and encoder cache; `write_cross_kv`
projects its output into every layer's cross-attention K/V, kept in the request's blocks of the cross-attention
group (`CrossAttentionSpec`, written once at the request's first step, read by every later one). The LM head is
the token embedding (tied). Unquantized, in one process.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.config import ConfigError
from kestrel.distributed.parallel import ParallelContext, single_process
from kestrel.model import loading
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.base import Quantization, TensorSpec
from kestrel.model.layers.attention import Attention
from kestrel.model.layers.audio import WhisperEncoder, WhisperEncoderArch
from kestrel.model.layers.cross_attention import CrossAttention, CrossReads
from kestrel.model.layers.vision import activation, loadable
from kestrel.quant import QuantPlan


@dataclass(frozen=True)
class WhisperDecoderArch:
    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    vocab_size: int
    max_target_positions: int
    activation: str
    scale_embedding: bool

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> WhisperDecoderArch:
        try:
            arch = cls(d_model=int(hf["d_model"]), num_layers=int(hf["decoder_layers"]),
                       num_heads=int(hf["decoder_attention_heads"]), ffn_dim=int(hf["decoder_ffn_dim"]),
                       vocab_size=int(hf["vocab_size"]), max_target_positions=int(hf["max_target_positions"]),
                       activation=str(hf.get("activation_function", "gelu")),
                       scale_embedding=bool(hf.get("scale_embedding", False)))
        except KeyError as e:
            raise ConfigError(f"invalid config.json: a Whisper checkpoint needs {e.args[0]}") from None
        if arch.d_model % arch.num_heads:
            raise ConfigError(f"invalid config.json: d_model={arch.d_model} is not divisible by "
                              f"decoder_attention_heads={arch.num_heads}")
        activation(arch.activation, "activation_function")
        return arch


class _Projections(nn.Module):
    """Whisper attention's q / k / v / out projections (k without bias), under the checkpoint's names."""

    def __init__(self, d_model: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d_model, d_model, dtype=dtype)
        self.k_proj = nn.Linear(d_model, d_model, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(d_model, d_model, dtype=dtype)
        self.out_proj = nn.Linear(d_model, d_model, dtype=dtype)


class WhisperDecoderLayer(nn.Module):
    def __init__(self, arch: WhisperDecoderArch, encoder_len: int, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        d, heads = arch.d_model, arch.num_heads
        head_size = d // heads
        prefix = f"model.decoder.layers.{index}"
        self.self_attn_layer_norm = nn.LayerNorm(d, dtype=dtype)
        self.self_attn = _Projections(d, dtype)
        self.self_attn.attn = Attention(heads, head_size, heads, head_size ** -0.5, layer_idx=2 * index,
                                        prefix=f"{prefix}.self_attn")
        self.encoder_attn_layer_norm = nn.LayerNorm(d, dtype=dtype)
        self.encoder_attn = _Projections(d, dtype)
        self.encoder_attn.attn = CrossAttention(heads, head_size, head_size ** -0.5, encoder_len,
                                                layer_idx=2 * index + 1, prefix=f"{prefix}.encoder_attn")
        self.final_layer_norm = nn.LayerNorm(d, dtype=dtype)
        self.fc1 = nn.Linear(d, arch.ffn_dim, dtype=dtype)
        self.fc2 = nn.Linear(arch.ffn_dim, d, dtype=dtype)
        self.act = activation(arch.activation, "activation_function")

    def forward(self, x: torch.Tensor, attn_metadata: AttentionMetadata, cross_reads: CrossReads) -> torch.Tensor:
        h = self.self_attn_layer_norm(x)
        s = self.self_attn
        x = x + s.out_proj(s.attn(s.q_proj(h), s.k_proj(h), s.v_proj(h), attn_metadata))
        c = self.encoder_attn
        x = x + c.out_proj(c.attn(c.q_proj(self.encoder_attn_layer_norm(x)), cross_reads))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))

    def write_cross_kv(self, encoder_states: torch.Tensor, slots: torch.Tensor) -> None:
        c = self.encoder_attn
        c.attn.store_encoder_kv(c.k_proj(encoder_states), c.v_proj(encoder_states), slots)


class WhisperDecoder(nn.Module):
    def __init__(self, arch: WhisperDecoderArch, encoder_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.d_model, dtype=dtype)
        self.embed_positions = nn.Embedding(arch.max_target_positions, arch.d_model, dtype=dtype)
        self.layers = nn.ModuleList(WhisperDecoderLayer(arch, encoder_len, i, dtype) for i in range(arch.num_layers))
        self.layer_norm = nn.LayerNorm(arch.d_model, dtype=dtype)
        self.embed_scale = arch.d_model ** 0.5 if arch.scale_embedding else 1.0


class WhisperForConditionalGeneration(nn.Module):
    supported_modalities: ClassVar[frozenset[str]] = frozenset({"audio"})
    # The runner's encoder step writes the cross-attention K/V (`write_cross_kv`) instead of input embeddings.
    is_encoder_decoder: ClassVar[bool] = True
    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {}
    skipped_checkpoint_suffixes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype = torch.float32,
                 quant_config: Quantization = None, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.parallel = parallel or single_process()
        if self.parallel.world_size > 1:
            raise ConfigError("invalid tensor_parallel_size / pipeline_parallel_size: Whisper runs in one process")
        if (quant_config is not None and not isinstance(quant_config, QuantPlan)) or (
                isinstance(quant_config, QuantPlan) and quant_config.scheme is not None):
            raise ConfigError("invalid quantization: kestrel runs Whisper unquantized; leave quantization unset")
        self.hf_config = hf_config
        self.dtype = dtype
        self.encoder_arch = WhisperEncoderArch.from_hf(hf_config)
        self.arch = WhisperDecoderArch.from_hf(hf_config)
        if self.encoder_arch.d_model != self.arch.d_model:
            raise ConfigError("invalid config.json: Whisper's encoder and decoder share d_model")
        self.hidden_size = self.arch.d_model
        self.vocab_size = self.arch.vocab_size
        self.encoder_len = self.encoder_arch.max_source_positions
        self.model = nn.Module()
        self.model.encoder = WhisperEncoder(self.encoder_arch, dtype)
        self.model.decoder = loadable(WhisperDecoder(self.arch, self.encoder_len, dtype))

    # ----- the step ---------------------------------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        decoder = self.model.decoder
        embeds = decoder.embed_tokens(input_ids)
        return embeds * decoder.embed_scale if decoder.embed_scale != 1.0 else embeds

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate_tensors: dict[str, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        decoder = self.model.decoder
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        x = x + decoder.embed_positions(positions)
        cross_reads = decoder.layers[0].encoder_attn.attn.read_tables(attn_metadata, x.shape[0])
        for layer in decoder.layers:
            x = layer(x, attn_metadata, cross_reads)
        return decoder.layer_norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.model.decoder.embed_tokens.weight).float()

    def embed_multimodal(self, modality: str, items: list[Any]) -> list[torch.Tensor]:
        """Each clip's `input_features [1, mels, window]` -> its encoder output `[max_source_positions, d_model]`;
        the step's clips run as one batch."""
        if modality != "audio":
            raise ValueError(f"Whisper takes audio, not {modality}")
        weight = self.model.encoder.conv1.weight
        features = torch.cat([item["input_features"] for item in items]).to(weight.device, self.dtype)
        frames = torch.full((features.shape[0],), features.shape[-1], dtype=torch.long)
        return list(self.model.encoder(features, frames).unbind(0))

    def write_cross_kv(self, encoder_states: list[torch.Tensor], block_ids: list[list[list[int]]]) -> None:
        """Every layer's cross-attention K/V of requests whose encoder outputs are `encoder_states` (one
        `[max_source_positions, d_model]` each), into their cross-attention blocks (`block_ids`: each request's
        block lists, one per KV-cache group)."""
        if not encoder_states:
            return
        states = torch.cat(encoder_states).to(self.dtype)
        layers = self.model.decoder.layers
        slots = layers[0].encoder_attn.attn.encoder_slots(block_ids, states.device)
        for layer in layers:
            layer.write_cross_kv(states, slots)

    def intermediate_specs(self, num_tokens: int) -> dict[str, TensorSpec]:
        return {}

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.model.decoder.layers)

    def attention_layers(self) -> list[Attention | CrossAttention]:
        """Each decoder layer's self-attention (full, group 0) then cross-attention (the cross group)."""
        return [m for layer in self.model.decoder.layers for m in (layer.self_attn.attn, layer.encoder_attn.attn)]

    def get_input_embeddings(self) -> nn.Module:
        return self.model.decoder.embed_tokens

    # ----- checkpoint -------------------------------------------------------------------------------------

    def checkpoint_target(self, hf_name: str) -> str | None:
        if hf_name == "proj_out.weight":
            return None  # tied to the token embedding
        if hf_name.startswith("model.encoder."):
            return "model.encoder." + WhisperEncoder.param_name(hf_name[len("model.encoder."):])
        return hf_name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loading.load_weights(self, weights)
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        return None
