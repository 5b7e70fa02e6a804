"""LLaVA-NeXT (`LlavaNextForConditionalGeneration`): LLaVA-1.5's CLIP tower, projector and decoder with anyres
images. The processor resizes an image onto the best fitting grid of `image_grid_pinpoints` and cuts it into
tower-sized tiles after a downscaled base image; every tile runs through the tower and projector, the tiles' features
are laid out as the grid's feature map, cropped back to the image's aspect ratio (the processor's padding removed)
and given an `image_newline` embedding at the end of every row. An image's placeholders are the base image's
features followed by that map, row by row, so their number depends on the image's size."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kestrel.config import ConfigError
from kestrel.distributed.parallel import ParallelContext
from kestrel.model.base import Quantization
from kestrel.model.layers.vision import CLIPVisionArch
from kestrel.model.layers.weights import default_weight_loader
from kestrel.model.llava import LlavaForConditionalGeneration

DEFAULT_GRID_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


def best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The pinpoint (height, width) the image is resized onto: the most of the image's pixels kept after an
    aspect-preserving downscale, then the fewest padding pixels (the processor's choice, made the same way)."""
    best, best_kept, best_wasted = pinpoints[0], -1, 0
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > best_kept or (kept == best_kept and wasted < best_wasted):
            best, best_kept, best_wasted = (h, w), kept, wasted
    return best


def crop_to_aspect(features: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """A `[hidden, rows, cols]` feature map of an image padded to the grid's shape, without the rows or columns of
    that padding (centered, as the processor pads)."""
    rows, cols = features.shape[1:]
    if width / height > cols / rows:
        kept = int(round(height * (cols / width), 7))
        pad = (rows - kept) // 2
        return features[:, pad:rows - pad]
    kept = int(round(width * (rows / height), 7))
    pad = (cols - kept) // 2
    return features[:, :, pad:cols - pad]


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype = torch.float32,
                 quant_config: Quantization = None, parallel: ParallelContext | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__(hf_config, dtype, quant_config, parallel, max_model_len)
        pinpoints = hf_config.get("image_grid_pinpoints") or DEFAULT_GRID_PINPOINTS
        try:
            self.grid_pinpoints = tuple((int(h), int(w)) for h, w in pinpoints)
        except (TypeError, ValueError):
            raise ConfigError(f"invalid image_grid_pinpoints={pinpoints!r}: expected [height, width] pairs") from None
        arch = CLIPVisionArch.from_hf(hf_config["vision_config"])
        self.tile_size = arch.image_size
        self.tile_patches = arch.image_size // arch.patch_size
        if not self.drops_class_token:
            raise ConfigError("invalid vision_feature_select_strategy='full': LLaVA-NeXT lays its tiles' features "
                              "out as a patch grid, which needs the class token dropped ('default')")
        for h, w in self.grid_pinpoints:
            if h <= 0 or w <= 0 or h % self.tile_size or w % self.tile_size:
                raise ConfigError(f"invalid image_grid_pinpoints: [{h}, {w}] is not a grid of the vision tower's "
                                  f"{self.tile_size}-pixel tiles")
        if self.parallel.is_first_stage:
            self.image_newline = nn.Parameter(torch.empty(self.hidden_size, dtype=dtype), requires_grad=False)
            self.image_newline.weight_loader = default_weight_loader

    def checkpoint_target(self, hf_name: str) -> str | None:
        if hf_name in ("image_newline", "model.image_newline"):
            return "image_newline" if self.parallel.is_first_stage else None
        return super().checkpoint_target(hf_name)

    def grid_shape(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of tiles of an image of `height` x `width` pixels."""
        h, w = best_resolution(height, width, self.grid_pinpoints)
        return h // self.tile_size, w // self.tile_size

    def embed_multimodal(self, modality: str, items: list[Any]) -> list[torch.Tensor]:
        """Each image's `pixel_values [1, max_tiles, 3, S, S]` (the base image first, then the grid row by row;
        padded to the longest image of its processor batch) and `image_sizes [1, 2]` -> its features; every tile
        of the step's images runs as one tower batch."""
        if modality != "image":
            raise ValueError(f"LLaVA-NeXT takes images, not {modality}")
        device = self.image_newline.device
        sizes = [tuple(int(v) for v in item["image_sizes"].reshape(-1)) for item in items]
        grids = [self.grid_shape(h, w) for h, w in sizes]
        tiles = [item["pixel_values"].reshape(-1, *item["pixel_values"].shape[-3:])[: rows * cols + 1]
                 for item, (rows, cols) in zip(items, grids)]
        features = self.image_features(torch.cat(tiles).to(device)).split([t.shape[0] for t in tiles])
        n = self.tile_patches
        outputs = []
        for feats, (rows, cols), (height, width) in zip(features, grids, sizes):
            # [rows * cols, n * n, hidden] -> [hidden, rows * n, cols * n]: the grid's feature map
            grid = feats[1:].reshape(rows, cols, n, n, -1).permute(4, 0, 2, 1, 3).reshape(-1, rows * n, cols * n)
            grid = crop_to_aspect(grid, height, width)
            newline = self.image_newline.to(grid.dtype)[:, None, None].expand(-1, grid.shape[1], 1)
            grid = torch.cat([grid, newline], dim=2).flatten(1).t()
            outputs.append(torch.cat([feats[0], grid]))
        return outputs
