"""An EAGLE-style draft head: one Llama decoder layer over fc([embed(token); feature]), as EAGLE-1 builds it.

At position p the head reads token t_p and the feature that preceded it (the target's last hidden state at p - 1,
after its final norm; or, while it drafts on its own, the head's previous output) and predicts a feature for p,
whose logits come from the target's LM head. The token embedding and the LM head are the target's (shared, not
stored in the head's checkpoint). Checkpoint tensors: `fc.weight` [hidden, 2 * hidden], `model.layers.0.*` (Llama
names) and `model.norm.weight`; config.json has the Llama fields with architectures ["KestrelEagleHead"].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from kestrel.config import ConfigError
from kestrel.distributed.parallel import single_process
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.layers.attention import Attention
from kestrel.model.layers.linear import RowLinear, process_linear_layers_after_loading
from kestrel.model.layers.norm import RMSNorm
from kestrel.model.layers.rotary import RotaryEmbedding
from kestrel.model.layers.weights import WeightShapeError
from kestrel.model.llama import (
    LlamaArchConfig,
    LlamaDecoderLayer,
    WeightLoadingError,
    _checkpoint_names,
    _to_param_name,
)
from kestrel.quant import get_quant_method


class _HeadBody(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, 0, dtype, None, "model.layers.0", rotary_emb,
                                                       single_process())])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class EagleHead(nn.Module):
    """`forward(input_ids [T], features [T, hidden], positions [T], attn_metadata, embed) -> features [T, hidden]`;
    `embed` is the target's token embedding."""

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if hf_config.get("num_hidden_layers", 1) != 1:
            raise ConfigError(f"invalid EAGLE head: num_hidden_layers={hf_config.get('num_hidden_layers')} in its "
                              "config.json; a head has one decoder layer")
        self.config = LlamaArchConfig.from_hf({**hf_config, "num_hidden_layers": 1})
        hidden = self.config.hidden_size
        self.fc = RowLinear(2 * hidden, hidden, bias=False, quant_method=get_quant_method(None, "fc"),
                            params_dtype=dtype)
        self.model = _HeadBody(self.config, dtype)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, embed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        x = self.fc(torch.cat([embed(input_ids), features.to(self.fc.weight.dtype)], dim=-1))
        hidden, residual = self.model.layers[0](positions, x, None, attn_metadata)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def attention_layers(self) -> list[Attention]:
        return [self.model.layers[0].self_attn.attn]

    def kv_cache_spec(self) -> tuple[int, int, int]:
        return 1, self.config.num_kv_heads, self.config.head_dim

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        expected = {hf for name, param in params.items() for hf in _checkpoint_names(name, param)}
        seen: set[str] = set()
        with torch.no_grad():
            for hf_name, tensor in weights:
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue
                name, shard_id = _to_param_name(hf_name)
                param = params.get(name)
                if param is None:
                    raise WeightLoadingError(f"checkpoint tensor {hf_name!r} has no matching parameter in EagleHead")
                try:
                    param.weight_loader(param, tensor, shard_id)
                except WeightShapeError as e:
                    raise WeightLoadingError(f"tensor {hf_name!r}: checkpoint shape {e.loaded_shape} does not match "
                                             f"the head's {e.expected_shape}") from e
                seen.add(hf_name)
        missing = sorted(expected - seen)
        if missing:
            raise WeightLoadingError(f"EAGLE head checkpoint is missing {len(missing)} tensor(s): "
                                     f"{', '.join(missing[:20])}")
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        process_linear_layers_after_loading(self)
