"""Qwen2-Audio (`Qwen2AudioForConditionalGeneration`): a Whisper-style audio encoder (average pooling of frame pairs
after its layers), a linear projector and a Qwen2 decoder read from `text_config`. A clip becomes one embedding per
40 ms of audio (its feature extractor's frames halved by the stem and again by the pooling) that replace its
`<|AUDIO|>` placeholders in the prompt."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kestrel.config import ConfigError
from kestrel.distributed.parallel import ParallelContext
from kestrel.model.base import Quantization
from kestrel.model.layers.audio import WhisperEncoder, WhisperEncoderArch
from kestrel.model.layers.vision import loadable
from kestrel.model.llama import Qwen2ForCausalLM
from kestrel.model.loading import renamed_by_prefix


class Qwen2AudioForConditionalGeneration(Qwen2ForCausalLM):
    supported_modalities: ClassVar[frozenset[str]] = frozenset({"audio"})
    # transformers 5's saved layout (`language_model.model.model.*`) and the published checkpoints'
    # (`language_model.model.*`) -> our names; the first matching prefix applies.
    _RENAMED: ClassVar[tuple[tuple[str, str], ...]] = (
        ("language_model.model.model.", "model."),
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.audio_tower.", "audio_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )
    POOL = 2

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype = torch.float32,
                 quant_config: Quantization = None, parallel: ParallelContext | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__(hf_config, dtype, quant_config, parallel, max_model_len)
        audio = hf_config.get("audio_config")
        if not isinstance(audio, dict):
            raise ConfigError("invalid config.json: a Qwen2-Audio checkpoint needs its audio_config")
        self.audio_arch = WhisperEncoderArch.from_hf(audio)
        self.audio_token_id = hf_config.get("audio_token_index", hf_config.get("audio_token_id"))
        if self.parallel.is_first_stage:  # the encoder step feeds the first stage's input embeddings
            self.audio_tower = WhisperEncoder(self.audio_arch, dtype, pool=self.POOL)
            self.multi_modal_projector = loadable(nn.Module())
            self.multi_modal_projector.linear = loadable(nn.Linear(self.audio_arch.d_model, self.hidden_size,
                                                                   dtype=dtype))

    def checkpoint_target(self, hf_name: str) -> str | None:
        hf_name = renamed_by_prefix(hf_name, self._RENAMED)
        if hf_name.startswith(("audio_tower.", "multi_modal_projector.")):
            if not self.parallel.is_first_stage:
                return None
            tower, _, rest = hf_name.partition(".")
            return f"{tower}.{WhisperEncoder.param_name(rest)}" if tower == "audio_tower" else hf_name
        return super().checkpoint_target(hf_name)

    def embed_multimodal(self, modality: str, items: list[Any]) -> list[torch.Tensor]:
        """Each clip's `input_features [1, mels, window]` and `feature_attention_mask [1, window]` -> its projected
        features `[placeholders, hidden]`; the step's clips run as one batch."""
        if modality != "audio":
            raise ValueError(f"Qwen2-Audio takes audio, not {modality}")
        weight = self.multi_modal_projector.linear.weight
        features = torch.cat([item["input_features"] for item in items]).to(weight.device, self.dtype)
        frames = torch.cat([item["feature_attention_mask"] for item in items]).sum(-1)
        states = self.multi_modal_projector.linear(self.audio_tower(features, frames))
        return [states[i, : self.audio_tower.output_length(int(n))] for i, n in enumerate(frames.tolist())]
