"""Expert-load counting: one int64 `[MoE layers, experts]` buffer on the device whose rows the model's
mixture-of-experts blocks add their real tokens' (token, expert) assignments to, inside the forward (CUDA graphs
included). The runner reads it off the hot path; nothing exists when the engine does not count."""

from __future__ import annotations

import torch
from torch import nn

from kestrel.config import ConfigError
from kestrel.model.layers.moe import MoEMLP


class ExpertLoad:
    """The counts since start (or the last `reset`) of every MoE layer of a model, by layer index."""

    def __init__(self, layers: tuple[int, ...], counts: torch.Tensor) -> None:
        self.layers = layers  # decoder-layer index of each row
        self.counts = counts  # int64 [len(layers), experts], on the model's device

    @classmethod
    def attach(cls, model: nn.Module) -> ExpertLoad:
        """Bind a counts row to each MoE block of `model` (a `CausalLM`); a model without one is refused."""
        blocks = [(i, layer.mlp) for i, layer in enumerate(model.decoder_layers())
                  if isinstance(getattr(layer, "mlp", None), MoEMLP)]
        if not blocks:
            raise ConfigError(f"invalid expert_load_metrics=True: expert_load_metrics needs a mixture-of-experts "
                              f"model, and {type(model).__name__} has no expert layers; leave it off")
        num_experts = {block.experts.num_experts for _, block in blocks}
        if len(num_experts) != 1:
            raise ValueError(f"MoE layers with different expert counts {sorted(num_experts)}")
        device = next(model.parameters()).device
        counts = torch.zeros(len(blocks), num_experts.pop(), dtype=torch.int64, device=device)
        for row, (_, block) in enumerate(blocks):
            block.expert_load = counts[row]
        return cls(tuple(i for i, _ in blocks), counts)

    def reset(self) -> None:
        """Forget what forwards that were no step (memory profile, graph capture, KV-scale calibration) counted."""
        self.counts.zero_()

    def to_dict(self, flat: list[int]) -> dict[int, list[int]]:
        """`counts` read to the host as one flat list -> {layer index: tokens per expert}."""
        width = self.counts.shape[1]
        return {layer: flat[row * width:(row + 1) * width] for row, layer in enumerate(self.layers)}

    def read(self) -> dict[int, list[int]]:
        """The counts now (waits for the device's queued work)."""
        return self.to_dict(self.counts.reshape(-1).tolist())
