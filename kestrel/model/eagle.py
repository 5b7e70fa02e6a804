"""An EAGLE-style draft head: one decoder layer over fc([embed(token); feature]), as EAGLE-1 builds it.

At position p the head reads token t_p and the feature that preceded it (the target's last hidden state at p - 1,
after its final norm; or, while it drafts on its own, the head's previous output) and predicts a feature for p,
whose logits come from the target's LM head. The token embedding and the LM head are the target's (shared, not
stored in the head's checkpoint). Checkpoint tensors: `fc.weight` [hidden, 2 * hidden], `model.layers.0.*` (Llama
names) and `model.norm.weight`; config.json has the Llama fields with architectures ["KestrelEagleHead"].
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import ClassVar

import torch
from torch import nn

from kestrel.config import ConfigError
from kestrel.distributed.parallel import single_process
from kestrel.model import loading
from kestrel.model.arch import DecoderArch
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.base import DecoderForCausalLM
from kestrel.model.layers.attention import Attention
from kestrel.model.layers.decoder import DecoderLayer
from kestrel.model.layers.linear import RowLinear, process_linear_layers_after_loading
from kestrel.model.layers.norm import RMSNorm
from kestrel.model.layers.rotary import RotaryEmbedding
from kestrel.quant import get_quant_method


class _HeadBody(nn.Module):
    def __init__(self, arch: DecoderArch, dtype: torch.dtype, packed: dict[str, tuple[str, ...]]) -> None:
        super().__init__()
        rotary_emb = RotaryEmbedding(arch.head_dim, arch.max_position, arch.rope)
        unquantized = functools.partial(get_quant_method, None)
        self.layers = nn.ModuleList([DecoderLayer(arch, 0, dtype, unquantized, "model.layers.0", rotary_emb,
                                                  single_process(), packed)])
        self.norm = RMSNorm(arch.hidden_size, arch.norm_eps, dtype)


class EagleHead(nn.Module):
    """`forward(input_ids [T], features [T, hidden], positions [T], attn_metadata, embed) -> features [T, hidden]`;
    `embed` is the target's token embedding."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = DecoderForCausalLM.packed_modules_mapping
    skipped_checkpoint_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if hf_config.get("num_hidden_layers", 1) != 1:
            raise ConfigError(f"invalid EAGLE head: num_hidden_layers={hf_config.get('num_hidden_layers')} in its "
                              "config.json; a head has one decoder layer")
        self.config = DecoderArch.from_hf({**hf_config, "num_hidden_layers": 1})
        self.hidden_size = self.config.hidden_size
        hidden = self.config.hidden_size
        self.fc = RowLinear(2 * hidden, hidden, bias=False, quant_method=get_quant_method(None, "fc"),
                            params_dtype=dtype)
        self.model = _HeadBody(self.config, dtype, self.packed_modules_mapping)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, embed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        x = self.fc(torch.cat([embed(input_ids), features.to(self.fc.weight.dtype)], dim=-1))
        hidden, residual = self.model.layers[0](positions, x, None, attn_metadata)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def attention_layers(self) -> list[Attention]:
        return [self.model.layers[0].self_attn.attn]

    def checkpoint_target(self, hf_name: str) -> str | None:
        return hf_name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        try:
            loading.load_weights(self, weights)
        except loading.WeightLoadingError as e:
            raise loading.WeightLoadingError(f"EAGLE head: {e}") from e
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        process_linear_layers_after_loading(self)
