"""Build a model from a ModelConfig and fill its weights (checkpoint or random)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from kestrel.config import EAGLE_HEAD_ARCHITECTURE, ConfigError, ModelConfig, QuantConfig, is_gguf_model
from kestrel.distributed.parallel import ParallelContext
from kestrel.loader.checkpoint_check import check_checkpoint_files
from kestrel.loader.dummy import initialize_dummy_weights
from kestrel.loader.gguf_files import find_gguf
from kestrel.loader.gguf_weights import iterate_gguf
from kestrel.loader.hf_config import load_hf_config, resolve_dtype
from kestrel.loader.memory_plan import KVCacheBytes, check_memory_plan, plan_memory
from kestrel.loader.model_init import checkpoint_shapes
from kestrel.loader.safetensors import checkpoint_files, iterate_files, weight_format
from kestrel.model.base import DecoderForCausalLM
from kestrel.model.registry import get_draft_head_class, get_model_class
from kestrel.quant import QuantPlan
from kestrel.quant.schemes.gguf import kernel_modules


def load_model(model_config: ModelConfig, quant_config: QuantConfig | None = None,
               device: str | torch.device = "cpu", parallel: ParallelContext | None = None,
               kv_cache_bytes: KVCacheBytes | None = None) -> nn.Module:
    """The model of `model_config.architecture` on `device`, weights loaded, in eval mode; with `parallel`,
    this rank's shard of it (its stage's layers, its slices of each sharded layer).

    Before anything is allocated, the weight files are checked (`checkpoint_check`) and the memory plan of the
    weights and of the KV cache `kv_cache_bytes` sizes (given its attention layers) must fit the device."""
    hf_config = model_config.hf_config or load_hf_config(model_config.model)
    architectures = hf_config.get("architectures") or [""]
    model_cls = get_model_class(architectures[0])
    dtype = resolve_dtype(model_config.dtype, hf_config)
    load_format = model_config.load_format
    gguf = find_gguf(model_config.model) if is_gguf_model(model_config.model) else None
    if gguf is not None and load_format not in ("auto", "dummy"):
        raise ConfigError(f"invalid load_format={load_format!r}: the model is a GGUF file; use 'auto'")
    if load_format == "auto":
        load_format = "gguf" if gguf is not None else weight_format(model_config.model) or "safetensors"
    # Listed before building the model, so that a directory without weights fails at once.
    files = checkpoint_files(model_config.model, load_format) if load_format not in ("dummy", "gguf") else []
    check_checkpoint_files(files, load_format)
    # The checkpoint's quantization_config, when it has one, decides each linear layer's method.
    plan = QuantPlan.build(quant_config, hf_config)
    if plan.checkpoint is not None and load_format == "dummy":
        raise ConfigError("invalid load_format='dummy': the checkpoint is quantized (quantization_config); random "
                          "weights exist only for unquantized models, or with quantization='fp8' / 'int8' at load")
    if load_format == "dummy":
        plan = dataclasses.replace(plan, random_weights=True)

    # Decoders compute length-dependent RoPE scaling for the context served.
    served = {"max_model_len": model_config.max_model_len} if issubclass(model_cls, DecoderForCausalLM) else {}

    def build() -> nn.Module:
        if parallel is None:
            return model_cls(hf_config, dtype, plan, **served)
        return model_cls(hf_config, dtype, plan, parallel, **served)

    check_memory_plan(plan_memory(build, kv_cache_bytes), hf_config, device, parallel, model_config.max_model_len,
                      dtype)
    try:
        with torch.device(device):
            model = build()
        if load_format == "dummy":
            initialize_dummy_weights(model, seed=model_config.seed, device=device)
            model.process_weights_after_loading()
        elif gguf is not None:
            model.load_weights(iterate_gguf(gguf, hf_config, kernel_modules(model), dtype, device))
        else:
            # Large checkpoints take a while: show progress when there is more than one file to read.
            model.load_weights(iterate_files(files, load_format, progress=len(files) > 1))
    except RuntimeError as error:
        # The host's allocator fails with a plain RuntimeError; torch.OutOfMemoryError is the device's.
        if not isinstance(error, torch.OutOfMemoryError) and "can't allocate memory" not in str(error):
            raise
        raise ConfigError(out_of_memory_message(hf_config, dtype, plan, parallel, device)) from error
    return model.eval()


def out_of_memory_message(hf_config: dict, dtype: torch.dtype, plan: QuantPlan, parallel: ParallelContext | None,
                          device: str | torch.device) -> str:
    """What the weights need per rank against what the device has, and the ways to make them fit."""
    tp = parallel.tp_size if parallel is not None else 1
    pp = parallel.pp_size if parallel is not None else 1
    eight_bit = plan.checkpoint is not None or (plan.user is not None and plan.user.method is not None)
    total = 0
    for name, shape in checkpoint_shapes(hf_config).items():
        size = 1 if eight_bit and name.endswith("proj.weight") else torch.empty((), dtype=dtype).element_size()
        total += math.prod(shape) * size
    have = ""
    if torch.device(device).type == "cuda":
        have = f" of the {torch.cuda.mem_get_info(torch.device(device))[1] / 1e9:.0f} GB on {device}"
    return (f"the model's weights do not fit: about {total / (tp * pp) / 1e9:.0f} GB per rank at tp={tp}, pp={pp}"
            f"{have} (out of memory while loading); use a larger tensor_parallel_size / pipeline_parallel_size"
            + ("" if eight_bit else ", or quantization='fp8'"))


def load_eagle_head(model_dir: str, dtype: torch.dtype, device: str | torch.device = "cpu",
                    load_format: str = "auto", seed: int = 0) -> nn.Module:
    """An EAGLE-style head (kestrel.model.eagle) from its directory: config.json and safetensors weights
    (random ones with load_format='dummy')."""
    hf_config = load_hf_config(model_dir)
    head_cls = get_draft_head_class((hf_config.get("architectures") or [EAGLE_HEAD_ARCHITECTURE])[0])
    fmt = weight_format(model_dir) or "safetensors"
    files = checkpoint_files(model_dir, fmt) if load_format != "dummy" else []
    check_checkpoint_files(files, fmt)

    def build() -> nn.Module:
        return head_cls(hf_config, dtype)

    check_memory_plan(plan_memory(build), hf_config, device, dtype=dtype)
    with torch.device(device):
        head = build()
    if load_format == "dummy":
        initialize_dummy_weights(head, seed=seed)
        head.process_weights_after_loading()
    else:
        head.load_weights(iterate_files(files, fmt))
    return head.eval()


__all__ = ["load_eagle_head", "load_model"]
