"""Build a model from a ModelConfig and fill its weights (checkpoint or random)."""

from __future__ import annotations

import torch
from torch import nn

from kestrel.config import ConfigError, ModelConfig, QuantConfig
from kestrel.distributed.parallel import ParallelContext
from kestrel.loader.dummy import initialize_dummy_weights
from kestrel.loader.hf_config import load_hf_config, resolve_dtype
from kestrel.loader.safetensors import checkpoint_files, iterate_files, weight_format
from kestrel.model.eagle import EagleHead
from kestrel.model.registry import get_model_class
from kestrel.quant import QuantPlan


def load_model(model_config: ModelConfig, quant_config: QuantConfig | None = None,
               device: str | torch.device = "cpu", parallel: ParallelContext | None = None) -> nn.Module:
    """The model of `model_config.architecture` on `device`, weights loaded, in eval mode; with `parallel`,
    this rank's shard of it (its stage's layers, its slices of each sharded layer)."""
    hf_config = model_config.hf_config or load_hf_config(model_config.model)
    architectures = hf_config.get("architectures") or [""]
    model_cls = get_model_class(architectures[0])
    dtype = resolve_dtype(model_config.dtype, hf_config)
    load_format = model_config.load_format
    if load_format == "auto":
        load_format = weight_format(model_config.model) or "safetensors"
    # Listed before building the model, so that a directory without weights fails at once.
    files = checkpoint_files(model_config.model, load_format) if load_format != "dummy" else []
    # The checkpoint's quantization_config, when it has one, decides each linear layer's method.
    plan = QuantPlan.build(quant_config, hf_config)
    if plan.checkpoint is not None and load_format == "dummy":
        raise ConfigError("invalid load_format='dummy': the checkpoint is quantized (quantization_config); random "
                          "weights exist only for unquantized models, or with quantization='fp8' / 'int8' at load")
    with torch.device(device):
        model = model_cls(hf_config, dtype, plan) if parallel is None else model_cls(hf_config, dtype, plan, parallel)
    if load_format == "dummy":
        initialize_dummy_weights(model, seed=model_config.seed)
        model.process_weights_after_loading()
    else:
        # Large checkpoints take a while: show progress when there is more than one file to read.
        model.load_weights(iterate_files(files, load_format, progress=len(files) > 1))
    return model.eval()


def load_eagle_head(model_dir: str, dtype: torch.dtype, device: str | torch.device = "cpu",
                    load_format: str = "auto", seed: int = 0) -> EagleHead:
    """An EAGLE-style head (kestrel.model.eagle) from its directory: config.json and safetensors weights
    (random ones with load_format='dummy')."""
    hf_config = load_hf_config(model_dir)
    with torch.device(device):
        head = EagleHead(hf_config, dtype)
    if load_format == "dummy":
        initialize_dummy_weights(head, seed=seed)
        head.process_weights_after_loading()
    else:
        fmt = weight_format(model_dir) or "safetensors"
        head.load_weights(iterate_files(checkpoint_files(model_dir, fmt), fmt))
    return head.eval()


__all__ = ["load_eagle_head", "load_model"]
