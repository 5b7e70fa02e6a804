"""Vision encoders and projectors shared by the vision-language families: the CLIP vision transformer (LLaVA-1.5 and
LLaVA-NeXT's tower), SigLIP's (Gemma 3's: CLIP's blocks, no class token, a biased patch embedding, its final
norm), the two-layer MLP projector onto a decoder's hidden size, and the Qwen2-VL / Qwen2.5-VL vision
transformer (2D rotary attention over dynamic-resolution patch grids, with its own merger).

The towers run on the whole image batch at once (bidirectional attention, no KV cache) in the model dtype and stay
unquantized; their parameters load with the plain checked copy, replicated on every tensor-parallel rank. A tower is
built only up to the deepest layer its model reads (LLaVA reads the second to last layer's output, so the last layer
and the final norm are never built, and their checkpoint tensors are skipped).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.config import ConfigError
from kestrel.model.layers.weights import copy_checked, default_weight_loader
from kestrel.model.loading import renamed_by_prefix


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# config.json's hidden_act / projector_hidden_act -> the activation
# A tower + projector + language model checkpoint (LLaVA's layout, which Gemma 3 shares): transformers 5 names
# (`model.language_model.*`, `model.vision_tower.*`) and the published ones (`language_model.model.*`,
# `vision_tower.vision_model.*`) -> ours; the first matching prefix applies.
TOWER_PROJECTOR_RENAMES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
class TowerProjectorNames:
    """`checkpoint_target` of a tower + projector + language model (before the model class in its bases): names
    mapped by `TOWER_PROJECTOR_RENAMES`; the `vision_tower.*` and `multi_modal_projector.*` tensors belong to the
    first pipeline stage, which runs the encoder step, and a tower tensor the tower does not read (layers past the
    deepest one read, a head the model does not use) is skipped; the rest is the language model's."""

    def checkpoint_target(self, hf_name: str) -> str | None:
        hf_name = renamed_by_prefix(hf_name, TOWER_PROJECTOR_RENAMES)
        for tower in ("vision_tower.", "multi_modal_projector."):
            if hf_name.startswith(tower):
                if not self.parallel.is_first_stage:  # type: ignore[attr-defined]
                    return None
                if tower == "vision_tower." and not self.vision_tower.reads(  # type: ignore[attr-defined]
                        hf_name[len(tower):]):
                    return None
                return hf_name
        return super().checkpoint_target(hf_name)  # type: ignore[misc]


VISION_ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu, "gelu_pytorch_tanh": _gelu_tanh,
                      "gelu_new": _gelu_tanh, "relu": F.relu, "silu": F.silu}


def activation(name: str, field: str) -> Any:
    fn = VISION_ACTIVATIONS.get(name)
    if fn is None:
        raise ConfigError(f"invalid {field}={name!r}: kestrel's vision layers know {', '.join(VISION_ACTIVATIONS)}")
    return fn


def loadable(module: nn.Module) -> nn.Module:
    """Give every parameter of a plain torch module the checked copy as its loader (no sharding, no quantization)."""
    for param in module.parameters():
        param.requires_grad_(False)
        if not hasattr(param, "weight_loader"):
            param.weight_loader = default_weight_loader
    return module


def stacked_linear(in_features: int, out_sizes: tuple[int, ...], shard_ids: tuple[str, ...],
                   dtype: torch.dtype) -> nn.Linear:
    """A linear layer whose output rows stack several checkpoint layers (shard i -> rows of `out_sizes[i]`)."""
    layer = nn.Linear(in_features, sum(out_sizes), dtype=dtype)
    layer.shard_ids = shard_ids
    offsets = dict(zip(shard_ids, itertools.accumulate((0, *out_sizes))))
    sizes = dict(zip(shard_ids, out_sizes))

    def load_shard(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id not in offsets:
            raise ValueError(f"this layer stacks the shards {shard_ids}; got shard id {shard_id!r}")
        copy_checked(param.data.narrow(0, offsets[shard_id], sizes[shard_id]), loaded)

    for param in layer.parameters():
        param.requires_grad_(False)
        param.weight_loader = load_shard
    return layer


@dataclass(frozen=True)
class CLIPVisionArch:
    """A CLIP vision tower's shapes (config.json's `vision_config`, with CLIPVisionConfig's defaults)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    image_size: int = 224
    patch_size: int = 32
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    @classmethod
    def from_hf(cls, vision: dict[str, Any]) -> CLIPVisionArch:
        model_type = vision.get("model_type", "clip_vision_model")
        if model_type != "clip_vision_model":
            raise ConfigError(f"invalid vision_config.model_type={model_type!r}: kestrel's LLaVA runs a CLIP vision "
                              "tower (clip_vision_model); SigLIP and other towers are not built yet")
        defaults = cls()
        arch = cls(
            hidden_size=int(vision.get("hidden_size", defaults.hidden_size)),
            intermediate_size=int(vision.get("intermediate_size", defaults.intermediate_size)),
            num_layers=int(vision.get("num_hidden_layers", defaults.num_layers)),
            num_heads=int(vision.get("num_attention_heads", defaults.num_heads)),
            image_size=int(vision.get("image_size", defaults.image_size)),
            patch_size=int(vision.get("patch_size", defaults.patch_size)),
            num_channels=int(vision.get("num_channels", defaults.num_channels)),
            layer_norm_eps=float(vision.get("layer_norm_eps", defaults.layer_norm_eps)),
            hidden_act=str(vision.get("hidden_act", defaults.hidden_act)),
        )
        if arch.hidden_size % arch.num_heads:
            raise ConfigError(f"invalid vision_config: hidden_size={arch.hidden_size} is not divisible by "
                              f"num_attention_heads={arch.num_heads}")
        activation(arch.hidden_act, "vision_config.hidden_act")
        return arch

    @classmethod
    def from_hf_siglip(cls, vision: dict[str, Any]) -> CLIPVisionArch:
        """A SigLIP vision tower (`siglip_vision_model`), with SiglipVisionConfig's defaults: the same blocks."""
        model_type = vision.get("model_type", "siglip_vision_model")
        if model_type != "siglip_vision_model":
            raise ConfigError(f"invalid vision_config.model_type={model_type!r}: expected a SigLIP vision tower "
                              "(siglip_vision_model)")
        siglip = {"patch_size": 16, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"}
        return cls.from_hf({**siglip, **vision, "model_type": "clip_vision_model"})

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class CLIPAttention(nn.Module):
    def __init__(self, arch: CLIPVisionArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.head_dim = arch.hidden_size // arch.num_heads
        hidden = arch.hidden_size
        # q, k and v in one GEMM; the checkpoint's q_proj / k_proj / v_proj load into their thirds (the decoders'
        # packed_modules_mapping names this module's parts too).
        self.qkv_proj = stacked_linear(hidden, (hidden, hidden, hidden), ("q", "k", "v"), dtype)
        self.out_proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        qkv = self.qkv_proj(x).view(batch, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], scale=1.0 / math.sqrt(self.head_dim))
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, hidden))


class CLIPMLP(nn.Module):
    def __init__(self, arch: CLIPVisionArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = activation(arch.hidden_act, "vision_config.hidden_act")
        self.fc1 = nn.Linear(arch.hidden_size, arch.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(arch.intermediate_size, arch.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, arch: CLIPVisionArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps, dtype=dtype)
        self.self_attn = CLIPAttention(arch, dtype)
        self.layer_norm2 = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps, dtype=dtype)
        self.mlp = CLIPMLP(arch, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEmbeddings(nn.Module):
    def __init__(self, arch: CLIPVisionArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_size = arch.patch_size
        self.image_size = arch.image_size
        self.class_embedding = nn.Parameter(torch.empty(arch.hidden_size, dtype=dtype))
        self.patch_embedding = nn.Conv2d(arch.num_channels, arch.hidden_size, kernel_size=arch.patch_size,
                                         stride=arch.patch_size, bias=False, dtype=dtype)
        self.position_embedding = nn.Embedding(arch.num_patches + 1, arch.hidden_size, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values of {tuple(pixel_values.shape[-2:])} pixels; this CLIP tower takes "
                             f"{self.image_size}x{self.image_size}")
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPVisionEncoder(nn.Module):
    """CLIP's vision transformer up to hidden state `depth` (0: the embeddings after the pre-norm; i: after layer
    i), with transformers' parameter names (`embeddings.*`, `pre_layrnorm.*`, `encoder.layers.N.*`)."""

    def __init__(self, arch: CLIPVisionArch, depth: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        self.depth = depth
        self.embeddings = CLIPEmbeddings(arch, dtype)
        self.pre_layrnorm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps, dtype=dtype)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(arch, dtype) for _ in range(depth))
        loadable(self)

    def reads(self, name: str) -> bool:
        """Whether a checkpoint tensor (a name inside the tower) is one of the built parameters."""
        if name.startswith("post_layernorm."):
            return False
        if name.startswith("encoder.layers."):
            return int(name[len("encoder.layers."):].split(".", 1)[0]) < self.depth
        return True

    def hidden_states(self, pixel_values: torch.Tensor, indices: list[int]) -> list[torch.Tensor]:
        """The hidden states at `indices` (each in 0..depth, as transformers' `hidden_states` tuple counts)."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in indices]


class SiglipVisionEncoder(nn.Module):
    """SigLIP's vision transformer with transformers' parameter names (`embeddings.patch_embedding`,
    `embeddings.position_embedding`, `encoder.layers.N.*`, `post_layernorm`): patches of `image_size` images, no
    class token, every layer, the final norm; its attention-pooling head (`head.*`) is not built."""

    def __init__(self, arch: CLIPVisionArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(arch.num_channels, arch.hidden_size, kernel_size=arch.patch_size,
                                                    stride=arch.patch_size, dtype=dtype)
        self.embeddings.position_embedding = nn.Embedding(arch.num_patches, arch.hidden_size, dtype=dtype)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(arch, dtype) for _ in range(arch.num_layers))
        self.post_layernorm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps, dtype=dtype)
        loadable(self)

    @staticmethod
    def reads(name: str) -> bool:
        """Whether a checkpoint tensor (a name inside the tower) is one of the built parameters."""
        return not name.startswith("head.")

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images `[N, 3, size, size]` -> the last hidden state after the final norm `[N, patches, hidden]`."""
        size = self.arch.image_size
        if pixel_values.shape[-2:] != (size, size):
            raise ValueError(f"pixel_values of {tuple(pixel_values.shape[-2:])} pixels; this SigLIP tower takes "
                             f"{size}x{size}")
        conv = self.embeddings.patch_embedding
        x = conv(pixel_values.to(conv.weight.dtype)).flatten(2).transpose(1, 2)
        x = x + self.embeddings.position_embedding.weight
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


def hidden_state_indices(feature_layer: int | list[int], num_layers: int, field: str) -> list[int]:
    """transformers' `hidden_states[layer]` indices (negative from the end of num_layers + 1 states) as
    non-negative ones."""
    layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    indices = []
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not -(num_layers + 1) <= layer <= num_layers:
            raise ConfigError(f"invalid {field}={feature_layer!r}: expected hidden-state indices in "
                              f"[-{num_layers + 1}, {num_layers}] of a {num_layers}-layer tower")
        indices.append(layer % (num_layers + 1))
    return indices


class MultiModalProjector(nn.Module):
    """`linear_1`, activation, `linear_2`: encoder features -> the decoder's hidden size."""

    def __init__(self, in_features: int, hidden_size: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = activation(act, "projector_hidden_act")
        self.linear_1 = nn.Linear(in_features, hidden_size, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(hidden_size, hidden_size, bias=bias, dtype=dtype)
        loadable(self)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


@dataclass(frozen=True)
class Qwen2VisionArch:
    """Qwen2-VL's vision transformer (config.json's `vision_config`, with Qwen2VLVisionConfig's defaults)."""

    embed_dim: int = 1280
    depth: int = 32
    num_heads: int = 16
    mlp_ratio: float = 4.0
    out_hidden_size: int = 3584  # the decoder's hidden size, what the merger projects onto
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10000.0
    # Qwen2.5-VL: RMS norms, a gated MLP of `intermediate_size`, and attention within windows of `window_size`
    # pixels (merge windows grouped) except in the `full_attention_blocks`.
    rms_norm: bool = False
    intermediate_size: int | None = None
    window_size: int | None = None
    full_attention_blocks: tuple[int, ...] = ()

    @classmethod
    def from_hf_qwen2_5(cls, vision: dict[str, Any]) -> Qwen2VisionArch:
        """Qwen2_5_VLVisionConfig's names and defaults: `hidden_size` is the tower's, `out_hidden_size` the
        decoder's."""
        renamed = {**vision, "embed_dim": vision.get("hidden_size", 1280), "hidden_size": vision.get(
            "out_hidden_size", 3584), "hidden_act": vision.get("hidden_act", "silu"),
            "depth": vision.get("depth", 32)}
        base = cls.from_hf(renamed)
        arch = dataclasses.replace(
            base, rms_norm=True, intermediate_size=int(vision.get("intermediate_size", 3420)),
            window_size=int(vision.get("window_size", 112)),
            full_attention_blocks=tuple(int(i) for i in vision.get("fullatt_block_indexes", (7, 15, 23, 31))))
        if arch.window_size % (arch.patch_size * arch.spatial_merge_size):
            raise ConfigError(f"invalid vision_config.window_size={arch.window_size}: expected a multiple of "
                              "patch_size * spatial_merge_size")
        return arch

    @classmethod
    def from_hf(cls, vision: dict[str, Any]) -> Qwen2VisionArch:
        defaults = cls()
        rope = vision.get("rope_parameters") or {}
        arch = cls(
            embed_dim=int(vision.get("embed_dim", defaults.embed_dim)),
            depth=int(vision.get("depth", defaults.depth)),
            num_heads=int(vision.get("num_heads", defaults.num_heads)),
            mlp_ratio=float(vision.get("mlp_ratio", defaults.mlp_ratio)),
            out_hidden_size=int(vision.get("hidden_size", defaults.out_hidden_size)),
            patch_size=int(vision.get("patch_size", defaults.patch_size)),
            temporal_patch_size=int(vision.get("temporal_patch_size", defaults.temporal_patch_size)),
            spatial_merge_size=int(vision.get("spatial_merge_size", defaults.spatial_merge_size)),
            in_channels=int(vision.get("in_channels", defaults.in_channels)),
            hidden_act=str(vision.get("hidden_act", defaults.hidden_act)),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", defaults.rope_theta))),
        )
        if arch.embed_dim % arch.num_heads or (arch.embed_dim // arch.num_heads) % 4:
            raise ConfigError(f"invalid vision_config: embed_dim={arch.embed_dim} over num_heads={arch.num_heads} "
                              "must give a head dim divisible by 4 (its halves rotate by height and by width)")
        activation(arch.hidden_act, "vision_config.hidden_act")
        return arch

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the whole last dim (its two halves paired), in float32; `cos`, `sin` `[..., D / 2]`."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class VisionRMSNorm(nn.Module):
    """RMS norm in float32, scaled after the cast back (Qwen2.5-VL's tower)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def vision_norm(arch: Qwen2VisionArch, size: int, dtype: torch.dtype) -> nn.Module:
    return VisionRMSNorm(size, 1e-6, dtype) if arch.rms_norm else nn.LayerNorm(size, eps=1e-6, dtype=dtype)


class Qwen2VisionAttention(nn.Module):
    def __init__(self, arch: Qwen2VisionArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.head_dim = arch.head_dim
        self.qkv = nn.Linear(arch.embed_dim, 3 * arch.embed_dim, dtype=dtype)
        self.proj = nn.Linear(arch.embed_dim, arch.embed_dim, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int],
                masks: list[torch.Tensor | None]) -> torch.Tensor:
        """`x [patches, embed_dim]` of several frames; each frame's `lengths` patches attend to one another, or,
        where the frame's `masks` entry is given, only where it is True (the patches of their own window)."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        out = []
        for q_f, k_f, v_f, mask in zip(q.split(lengths), k.split(lengths), v.split(lengths), masks):
            out.append(F.scaled_dot_product_attention(q_f.transpose(0, 1), k_f.transpose(0, 1), v_f.transpose(0, 1),
                                                      attn_mask=mask, scale=self.head_dim ** -0.5))
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(x.shape[0], -1))


class Qwen2VisionBlock(nn.Module):
    def __init__(self, arch: Qwen2VisionArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = vision_norm(arch, arch.embed_dim, dtype)
        self.norm2 = vision_norm(arch, arch.embed_dim, dtype)
        self.attn = Qwen2VisionAttention(arch, dtype)
        self.mlp = nn.Module()
        self.gated = arch.intermediate_size is not None
        if self.gated:
            hidden = arch.intermediate_size
            # the checkpoint's gate_proj / up_proj load into their halves (the decoders' packing names them)
            self.mlp.gate_up_proj = stacked_linear(arch.embed_dim, (hidden, hidden), ("gate", "up"), dtype)
            self.mlp.down_proj = nn.Linear(hidden, arch.embed_dim, dtype=dtype)
        else:
            hidden = int(arch.embed_dim * arch.mlp_ratio)
            self.mlp.fc1 = nn.Linear(arch.embed_dim, hidden, dtype=dtype)
            self.mlp.fc2 = nn.Linear(hidden, arch.embed_dim, dtype=dtype)
        self.act = activation(arch.hidden_act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int],
                masks: list[torch.Tensor | None]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths, masks)
        h = self.norm2(x)
        if self.gated:
            gate, up = self.mlp.gate_up_proj(h).chunk(2, dim=-1)
            return x + self.mlp.down_proj(self.act(gate) * up)
        return x + self.mlp.fc2(self.act(self.mlp.fc1(h)))


class Qwen2VisionTransformer(nn.Module):
    """Qwen2-VL's vision tower with transformers' parameter names (`patch_embed.proj`, `blocks.N.*`,
    `merger.*`): patches of `temporal_patch_size` frames x `patch_size`^2 pixels (the processor flattens them, every
    `spatial_merge_size`^2 consecutive patches one merge window), 2D rotary attention within each frame, and the
    merger (LayerNorm, each window's patches concatenated, a two-layer GELU MLP onto the decoder's hidden size)."""

    def __init__(self, arch: Qwen2VisionArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        self.patch_embed = nn.Module()
        kernel = (arch.temporal_patch_size, arch.patch_size, arch.patch_size)
        self.patch_embed.proj = nn.Conv3d(arch.in_channels, arch.embed_dim, kernel_size=kernel, stride=kernel,
                                          bias=False, dtype=dtype)
        self.blocks = nn.ModuleList(Qwen2VisionBlock(arch, dtype) for _ in range(arch.depth))
        merged = arch.embed_dim * arch.spatial_merge_size ** 2
        self.merger = nn.Module()
        self.merger.ln_q = vision_norm(arch, arch.embed_dim, dtype)
        self.merger.mlp = nn.Sequential(nn.Linear(merged, merged, dtype=dtype), nn.GELU(),
                                        nn.Linear(merged, arch.out_hidden_size, dtype=dtype))
        spatial = arch.head_dim // 2
        self.register_buffer("inv_freq", 1.0 / arch.rope_theta ** (
            torch.arange(0, spatial, 2, dtype=torch.float32) / spatial), persistent=False)
        loadable(self)

    def patch_positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """(row, column) of every patch `[patches, 2]`, in the processor's order: frame, merge window row by row,
        then the window's patches row by row."""
        m = self.arch.spatial_merge_size
        out = []
        for t, h, w in grids:
            rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            frame = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=1)
            out.append(frame.repeat(t, 1))
        return torch.cat(out)

    def window_ids(self, grids: list[tuple[int, int, int]], device: torch.device) -> list[torch.Tensor | None]:
        """Each frame's window of every patch (in the processor's order): squares of `window_size` pixels over
        the frame's merge windows, counted from its top left corner."""
        m = self.arch.spatial_merge_size
        side = self.arch.window_size // (m * self.arch.patch_size)  # merge windows along a window's side
        out: list[torch.Tensor | None] = []
        for t, h, w in grids:
            rows = torch.arange(h // m).view(-1, 1) // side
            cols = torch.arange(w // m).view(1, -1) // side
            ids = (rows * (-(-(w // m) // side)) + cols).flatten().repeat_interleave(m * m).to(device)
            out += [ids] * t
        return out

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Flattened patches `[patches, channels * temporal * patch^2]` of images with (frames, rows, columns)
        `grids` -> merged features `[patches / merge^2, out_hidden_size]`."""
        arch = self.arch
        proj = self.patch_embed.proj
        x = proj(pixel_values.to(proj.weight.dtype).view(-1, arch.in_channels, arch.temporal_patch_size,
                                                          arch.patch_size, arch.patch_size)).view(-1, arch.embed_dim)
        positions = self.patch_positions(grids).to(x.device)
        freqs = (positions[:, :, None].float() * self.inv_freq).flatten(1)  # [patches, head_dim / 2]: rows, columns
        cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        frames: list[torch.Tensor | None] = [None] * len(lengths)
        # each frame's window mask, built once for every windowed block (a frame's patches squared)
        windows = frames if self.arch.window_size is None else [
            ids[:, None] == ids[None, :] for ids in self.window_ids(grids, x.device)]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths, frames if i in self.arch.full_attention_blocks else windows)
        x = self.merger.ln_q(x).view(-1, arch.embed_dim * arch.spatial_merge_size ** 2)
        return self.merger.mlp(x)
