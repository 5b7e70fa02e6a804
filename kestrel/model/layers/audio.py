"""The Whisper audio encoder, shared by the audio-language families (Qwen2-Audio's tower; Whisper itself later): a
two-convolution stem over log-mel frames (the second halves the frame rate), absolute position embeddings (a
checkpoint tensor: Whisper's are sinusoids, Qwen2-Audio's learned), pre-norm bidirectional transformer layers, an
optional average pooling of neighbouring frames and a final LayerNorm. (`scale_embedding` is not read: neither
family's encoder applies it.)

Clips of one batch are padded to the feature extractor's window; padded frames are masked as keys, so a clip's
outputs depend only on its own frames (the stem's convolutions see the padding's log-mel frames at the clip's end,
as the checkpoint was trained). Like the vision towers it runs unquantized in the model dtype, replicated on every
rank, and loads with the plain checked copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.config import ConfigError
from kestrel.model.layers.vision import activation, loadable


@dataclass(frozen=True)
class WhisperEncoderArch:
    """An audio encoder's shapes (config.json's `audio_config`, with WhisperConfig's names and defaults)."""

    d_model: int = 1280
    num_layers: int = 32
    num_heads: int = 20
    ffn_dim: int = 5120
    num_mel_bins: int = 128
    max_source_positions: int = 1500
    activation: str = "gelu"

    @classmethod
    def from_hf(cls, audio: dict[str, Any]) -> WhisperEncoderArch:
        default = cls()
        arch = cls(d_model=int(audio.get("d_model", default.d_model)),
                   num_layers=int(audio.get("encoder_layers", default.num_layers)),
                   num_heads=int(audio.get("encoder_attention_heads", default.num_heads)),
                   ffn_dim=int(audio.get("encoder_ffn_dim", default.ffn_dim)),
                   num_mel_bins=int(audio.get("num_mel_bins", default.num_mel_bins)),
                   max_source_positions=int(audio.get("max_source_positions", default.max_source_positions)),
                   activation=str(audio.get("activation_function", default.activation)))
        for name in ("d_model", "num_layers", "num_heads", "ffn_dim", "num_mel_bins", "max_source_positions"):
            if getattr(arch, name) < 1:
                raise ConfigError(f"invalid audio_config: {name}={getattr(arch, name)} must be positive")
        if arch.d_model % arch.num_heads:
            raise ConfigError(f"invalid audio_config: d_model={arch.d_model} is not divisible by "
                              f"encoder_attention_heads={arch.num_heads}")
        activation(arch.activation, "audio_config.activation_function")
        return arch

    @property
    def num_frames(self) -> int:
        """Mel frames of one window (the stem's second convolution halves them into the positions)."""
        return 2 * self.max_source_positions


class WhisperAttention(nn.Module):
    # Separate q / k / v (named so that the decoders' q/k/v -> qkv_proj packing leaves them alone): k has no bias,
    # so they do not stack into one biased layer.
    def __init__(self, arch: WhisperEncoderArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.q = nn.Linear(arch.d_model, arch.d_model, dtype=dtype)
        self.k = nn.Linear(arch.d_model, arch.d_model, bias=False, dtype=dtype)
        self.v = nn.Linear(arch.d_model, arch.d_model, dtype=dtype)
        self.out_proj = nn.Linear(arch.d_model, arch.d_model, dtype=dtype)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """`x [B, T, d]`, `key_mask [B, T]` (True: a frame of the clip; None: every frame) -> `[B, T, d]`."""
        b, t, d = x.shape
        q, k, v = (proj(x).view(b, t, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, d))


class WhisperEncoderLayer(nn.Module):
    def __init__(self, arch: WhisperEncoderArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(arch.d_model, dtype=dtype)
        self.self_attn = WhisperAttention(arch, dtype)
        self.final_layer_norm = nn.LayerNorm(arch.d_model, dtype=dtype)
        self.fc1 = nn.Linear(arch.d_model, arch.ffn_dim, dtype=dtype)
        self.fc2 = nn.Linear(arch.ffn_dim, arch.d_model, dtype=dtype)
        self.act = activation(arch.activation, "audio_config.activation_function")

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    """Log-mel features `[B, mels, frames]` -> hidden states `[B, positions / pool, d_model]`; `pool` frames are
    averaged after the layers (Qwen2-Audio: 2; Whisper: 1)."""

    def __init__(self, arch: WhisperEncoderArch, dtype: torch.dtype, pool: int = 1) -> None:
        super().__init__()
        self.arch = arch
        self.pool = pool
        self.conv1 = nn.Conv1d(arch.num_mel_bins, arch.d_model, kernel_size=3, padding=1, dtype=dtype)
        self.conv2 = nn.Conv1d(arch.d_model, arch.d_model, kernel_size=3, stride=2, padding=1, dtype=dtype)
        self.embed_positions = nn.Embedding(arch.max_source_positions, arch.d_model, dtype=dtype)
        self.layers = nn.ModuleList(WhisperEncoderLayer(arch, dtype) for _ in range(arch.num_layers))
        self.layer_norm = nn.LayerNorm(arch.d_model, dtype=dtype)
        loadable(self)

    @staticmethod
    def param_name(hf_name: str) -> str:
        """The parameter a checkpoint tensor of the encoder (its name below the encoder) loads into."""
        for proj in ("q", "k", "v"):
            hf_name = hf_name.replace(f".self_attn.{proj}_proj.", f".self_attn.{proj}.")
        return hf_name

    @staticmethod
    def positions_of(num_frames: int) -> int:
        """Positions after the stem of a clip of `num_frames` mel frames (the stride-2 convolution)."""
        return (num_frames - 1) // 2 + 1

    def output_length(self, num_frames: int) -> int:
        """Output rows of a clip of `num_frames` valid mel frames."""
        positions = self.positions_of(num_frames)
        return positions if self.pool == 1 else (positions - self.pool) // self.pool + 1

    def forward(self, features: torch.Tensor, num_frames: torch.Tensor) -> torch.Tensor:
        """`features [B, mels, window]` (every clip padded to the window), `num_frames [B]` each clip's valid
        frames -> `[B, window positions / pool, d_model]`; rows past a clip's `output_length` are padding."""
        if features.shape[-1] != self.arch.num_frames:
            raise ValueError(f"the audio encoder takes windows of {self.arch.num_frames} mel frames, got "
                             f"{features.shape[-1]}")
        x = F.gelu(self.conv1(features))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions.weight[: x.shape[1]]
        key_mask = None  # every clip fills the window (Whisper's): no mask, so SDPA may take its fused kernels
        if bool((num_frames < features.shape[-1]).any()):
            positions = (num_frames.to(x.device) - 1) // 2 + 1
            key_mask = torch.arange(x.shape[1], device=x.device)[None, :] < positions[:, None]
        for layer in self.layers:
            x = layer(x, key_mask)
        if self.pool > 1:
            x = F.avg_pool1d(x.transpose(1, 2), self.pool, self.pool).transpose(1, 2)
        return self.layer_norm(x)
