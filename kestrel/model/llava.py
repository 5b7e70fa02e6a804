"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer MLP projector and a Llama-family
decoder read from `text_config`. An image becomes `(image_size / patch_size)^2` embeddings (plus the class token
under `vision_feature_select_strategy="full"`) that replace its `<image>` placeholders in the prompt."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kestrel.config import ConfigError
from kestrel.distributed.parallel import ParallelContext
from kestrel.model.base import DecoderForCausalLM, Quantization
from kestrel.model.layers.vision import (
    CLIPVisionArch,
    CLIPVisionEncoder,
    MultiModalProjector,
    TowerProjectorNames,
    hidden_state_indices,
)


class LlavaForConditionalGeneration(TowerProjectorNames, DecoderForCausalLM):
    supported_modalities: ClassVar[frozenset[str]] = frozenset({"image"})

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype = torch.float32,
                 quant_config: Quantization = None, parallel: ParallelContext | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__(hf_config, dtype, quant_config, parallel, max_model_len)
        vision = hf_config.get("vision_config")
        if not isinstance(vision, dict):
            raise ConfigError("invalid config.json: a LLaVA checkpoint needs its vision_config")
        strategy = hf_config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ConfigError(f"invalid vision_feature_select_strategy={strategy!r}: expected 'default' (the class "
                              "token dropped) or 'full'")
        self.drops_class_token = strategy == "default"
        arch = CLIPVisionArch.from_hf(vision)
        self.feature_indices = hidden_state_indices(hf_config.get("vision_feature_layer", -2), arch.num_layers,
                                                    "vision_feature_layer")
        self.image_token_id = hf_config.get("image_token_index", hf_config.get("image_token_id"))
        if self.parallel.is_first_stage:  # the encoder step feeds the first stage's input embeddings
            self.vision_tower = CLIPVisionEncoder(arch, max(self.feature_indices), dtype)
            self.multi_modal_projector = MultiModalProjector(
                arch.hidden_size * len(self.feature_indices), self.hidden_size,
                hf_config.get("projector_hidden_act", "gelu"), bool(hf_config.get("multimodal_projector_bias", True)),
                dtype)

    def embed_multimodal(self, modality: str, items: list[Any]) -> list[torch.Tensor]:
        """Each image's `pixel_values [1, 3, H, W]` -> its projected features `[placeholders, hidden]`; images of
        one size run as one batch."""
        if modality != "image":
            raise ValueError(f"LLaVA takes images, not {modality}")
        device = self.multi_modal_projector.linear_1.weight.device
        pixels = [item["pixel_values"] for item in items]
        outputs: list[torch.Tensor | None] = [None] * len(pixels)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(pixels):
            by_shape.setdefault(tuple(p.shape[1:]), []).append(i)
        for indices in by_shape.values():
            features = self.image_features(torch.cat([pixels[i] for i in indices]).to(device))
            for row, i in enumerate(indices):
                outputs[i] = features[row]
        return outputs  # type: ignore[return-value]

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tower images `[N, 3, size, size]` -> their projected features `[N, tokens, hidden]`."""
        states = self.vision_tower.hidden_states(pixel_values.to(self.dtype), self.feature_indices)
        if self.drops_class_token:
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))
