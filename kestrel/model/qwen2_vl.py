"""Qwen2-VL (`Qwen2VLForConditionalGeneration`) and Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`, its tower
with window attention): a vision transformer over dynamic-resolution patch grids (the
processor picks each image's grid, `image_grid_thw`, and so its placeholder count), 2x2 patch windows merged onto a
Qwen2 decoder that rotates by M-RoPE: every token has three positions (temporal, height, width), the same for text
and an image's grid coordinates for its placeholders, and `mrope_section` splits the rotary frequencies into three
sections, each turned by one of them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from kestrel.config import ConfigError
from kestrel.distributed.parallel import ParallelContext
from kestrel.model.base import Quantization
from kestrel.model.layers.vision import Qwen2VisionArch, Qwen2VisionTransformer
from kestrel.model.llama import Qwen2ForCausalLM
from kestrel.model.loading import renamed_by_prefix


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    supported_modalities: ClassVar[frozenset[str]] = frozenset({"image"})
    # transformers 5 (`model.language_model.*`, `model.visual.*`) and the published layout (`model.*`, `visual.*`)
    _RENAMED: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.language_model.", "model."),
        ("model.visual.", "visual."),
    )

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype = torch.float32,
                 quant_config: Quantization = None, parallel: ParallelContext | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__(hf_config, dtype, quant_config, parallel, max_model_len)
        vision = hf_config.get("vision_config")
        if not isinstance(vision, dict):
            raise ConfigError("invalid config.json: a Qwen2-VL checkpoint needs its vision_config")
        if self.model.layers[self.model.stage_layers[0]].self_attn.rotary_emb.mrope_rows is None:
            raise ConfigError("invalid config.json: Qwen2-VL's rope_parameters (or rope_scaling) need "
                              "mrope_section")
        self.vision_arch = self.vision_arch_of(vision)
        if self.vision_arch.out_hidden_size != self.hidden_size:
            raise ConfigError(f"invalid vision_config.hidden_size={self.vision_arch.out_hidden_size}: the merger "
                              f"projects onto the decoder's hidden size, {self.hidden_size}")
        self.image_token_id = hf_config.get("image_token_id")
        if self.parallel.is_first_stage:
            self.visual = Qwen2VisionTransformer(self.vision_arch, dtype)

    @classmethod
    def vision_arch_of(cls, vision: dict[str, Any]) -> Qwen2VisionArch:
        return Qwen2VisionArch.from_hf(vision)

    def checkpoint_target(self, hf_name: str) -> str | None:
        hf_name = renamed_by_prefix(hf_name, self._RENAMED)
        if hf_name.startswith("visual."):
            return hf_name if self.parallel.is_first_stage else None
        return super().checkpoint_target(hf_name)

    @staticmethod
    def _grid(item_data: dict[str, Any]) -> tuple[int, int, int]:
        t, h, w = (int(v) for v in item_data["image_grid_thw"].reshape(-1))
        return t, h, w

    def embed_multimodal(self, modality: str, items: list[Any]) -> list[torch.Tensor]:
        """Each image's flattened patches `pixel_values [patches, ...]` and `image_grid_thw [1, 3]` -> its merged
        features; every image of the step runs as one tower pass."""
        if modality != "image":
            raise ValueError(f"Qwen2-VL takes images, not {modality}")
        grids = [self._grid(item) for item in items]
        device = self.visual.inv_freq.device
        pixels = torch.cat([item["pixel_values"] for item in items]).to(device)
        features = self.visual(pixels, grids)
        window = self.vision_arch.spatial_merge_size ** 2
        return list(features.split([t * h * w // window for t, h, w in grids]))

    def mrope_positions(self, prompt_ids: list[int], media: Sequence[Any]) -> tuple[torch.Tensor, int]:
        """The prompt's M-RoPE positions `[3, prompt length]` and the offset of every later token's (position + offset
        in all three rows): text continues one past the largest position before it; an image's placeholders are
        its merged grid (frame, row, column), each counted from the position the image starts at, and the text
        after it starts that many positions on as the grid's longer side. `media`: the request's media items
        (`ranges`, and the processor's `data`)."""
        m = self.vision_arch.spatial_merge_size
        pieces: list[torch.Tensor] = []
        cursor = next_position = 0
        for item in sorted(media, key=lambda it: it.start):
            if len(item.ranges) != 1:
                raise ValueError(f"a Qwen2-VL image's placeholders are one run, not {len(item.ranges)}")
            start, length = item.ranges[0]
            pieces.append(torch.arange(start - cursor).expand(3, -1) + next_position)
            next_position += start - cursor
            t, h, w = self._grid(item.data)
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h // m), torch.arange(w // m),
                                              indexing="ij")).flatten(1)
            if grid.shape[1] != length:
                raise ValueError(f"an image of grid {t}x{h}x{w} has {grid.shape[1]} merged patches for {length} "
                                 "placeholders")
            pieces.append(grid + next_position)
            next_position += max(h, w) // m
            cursor = start + length
        pieces.append(torch.arange(len(prompt_ids) - cursor).expand(3, -1) + next_position)
        next_position += len(prompt_ids) - cursor
        return torch.cat(pieces, dim=1), next_position - len(prompt_ids)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: Qwen2-VL's decoder, M-RoPE and processor; its tower has RMS norms, gated MLPs, and attends within
    windows of `window_size` pixels except in its `fullatt_block_indexes` blocks."""

    @classmethod
    def vision_arch_of(cls, vision: dict[str, Any]) -> Qwen2VisionArch:
        return Qwen2VisionArch.from_hf_qwen2_5(vision)
