"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): a SigLIP vision tower, Gemma 3's projector (the tower's
patch grid average-pooled to `mm_tokens_per_image` tokens, a `(1 + weight)` RMS norm, one projection matrix) and the
Gemma 3 decoder read from `text_config`. An image's placeholders (`<image_soft_token>`, between the processor's
`<start_of_image>` and `<end_of_image>`) attend to one another both ways during the prefill, as transformers' mask
does; text and later tokens see them causally (`bidirectional_media`)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.config import ConfigError
from kestrel.distributed.parallel import ParallelContext
from kestrel.model.base import Quantization
from kestrel.model.gemma import Gemma3ForCausalLM
from kestrel.model.layers.vision import CLIPVisionArch, SiglipVisionEncoder, TowerProjectorNames, loadable


class Gemma3MultiModalProjector(nn.Module):
    """The tower's `[N, side^2, vision_hidden]` features -> `[N, mm_tokens_per_image, hidden]`: the patch grid
    average-pooled to `sqrt(mm_tokens_per_image)` per side, RMS-normed with `(1 + weight)` in float32, times
    `mm_input_projection_weight [vision_hidden, hidden]`."""

    def __init__(self, arch: CLIPVisionArch, hidden_size: int, tokens_per_image: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.patches_per_side = arch.image_size // arch.patch_size
        tokens_per_side = math.isqrt(tokens_per_image)
        if tokens_per_side ** 2 != tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ConfigError(f"invalid mm_tokens_per_image={tokens_per_image}: expected a square whose side divides "
                              f"the tower's {self.patches_per_side} patches per side")
        self.kernel = self.patches_per_side // tokens_per_side
        self.eps = arch.layer_norm_eps
        self.mm_input_projection_weight = nn.Parameter(torch.empty(arch.hidden_size, hidden_size, dtype=dtype))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(arch.hidden_size, dtype=dtype))
        loadable(self)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        n, _, hidden = features.shape
        grid = features.transpose(1, 2).reshape(n, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.mm_soft_emb_norm.weight.float())
        return torch.matmul(x.to(features.dtype), self.mm_input_projection_weight)


class Gemma3ForConditionalGeneration(TowerProjectorNames, Gemma3ForCausalLM):
    supported_modalities: ClassVar[frozenset[str]] = frozenset({"image"})
    # An image's placeholder run attends to itself both ways (the runner widens its rows' causal ends; the
    # scheduler keeps each run inside one prefill chunk).
    bidirectional_media: ClassVar[bool] = True

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype = torch.float32,
                 quant_config: Quantization = None, parallel: ParallelContext | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__(hf_config, dtype, quant_config, parallel, max_model_len)
        vision = hf_config.get("vision_config")
        if not isinstance(vision, dict):
            raise ConfigError("invalid config.json: a Gemma 3 vision-language checkpoint needs its vision_config")
        arch = CLIPVisionArch.from_hf_siglip(vision)
        self.tokens_per_image = int(hf_config.get("mm_tokens_per_image", 256))
        if self.parallel.is_first_stage:  # the encoder step feeds the first stage's input embeddings
            self.vision_tower = SiglipVisionEncoder(arch, dtype)
            self.multi_modal_projector = Gemma3MultiModalProjector(arch, self.hidden_size, self.tokens_per_image,
                                                                   dtype)

    def embed_multimodal(self, modality: str, items: list[Any]) -> list[torch.Tensor]:
        """Each image's `pixel_values [crops, 3, size, size]` (the image, then its pan-and-scan crops) -> its
        projected features `[crops * mm_tokens_per_image, hidden]`; the step's images run as one tower batch."""
        if modality != "image":
            raise ValueError(f"Gemma 3 takes images, not {modality}")
        weight = self.multi_modal_projector.mm_input_projection_weight
        pixels = [item["pixel_values"] for item in items]
        features = self.multi_modal_projector(self.vision_tower(torch.cat(pixels).to(weight.device, self.dtype)))
        sizes = [p.shape[0] for p in pixels]
        return [f.reshape(-1, f.shape[-1]) for f in features.split(sizes)]
