"""A GGUF model's tensors as (Hugging Face name, tensor) pairs for `load_weights`.

Names: llama.cpp's (`blk.0.attn_q.weight`) mapped to the checkpoint names of kestrel's model (`model.layers.0.
self_attn.q_proj.weight`) by inverting gguf's own table (`gguf.get_tensor_name_map`) over the model's tensor names.
llama.cpp's converter reorders the rows of Llama's q and k projections within each head (from the half-split RoPE
layout to the interleaved one its kernels use); they are put back as transformers' GGUF loader does.

Values: the tensors of layers on the weight-only kernel (`kestrel.quant.schemes.gguf`) are unpacked from their blocks
into its int-quantized layout (`weight` int8 [N, K], `weight_scale` float32 [N, K / 32]); every other tensor is
dequantized to float32 by `gguf.quants.dequantize` (vectorized numpy), one tensor at a time, and the model's loader
rounds it to the model dtype.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kestrel.config import ConfigError
from kestrel.loader.gguf_files import GGUFModel
from kestrel.loader.model_init import checkpoint_shapes
from kestrel.quant.schemes.gguf import GGUF_GROUP, KERNEL_TYPES

logger = logging.getLogger(__name__)

# GGUF architecture -> whether llama.cpp's converter permuted its q/k rows (LlamaModel.permute).
ARCHITECTURES: dict[str, bool] = {"llama": True, "qwen2": False, "qwen3": False}
# Types dequantized at load (no kernel layout for them), besides the kernel types that a merged layer cannot use.
DEQUANTIZED_TYPES = ("F32", "F16", "BF16", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = (*DEQUANTIZED_TYPES, *KERNEL_TYPES)
# Llama 3.1's per-frequency RoPE divisors, which the config reader turns into the model's RoPE parameters.
ROPE_FREQS = "rope_freqs.weight"


def check_architecture(architecture: Any) -> str:
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"invalid model: the GGUF file's architecture (general.architecture) is {architecture!r}; "
                          f"kestrel loads GGUF files of {sorted(ARCHITECTURES)}")
    return architecture


def check_tensor_types(model: GGUFModel) -> None:
    """A ConfigError naming the first tensor of each type kestrel cannot load."""
    unsupported = {}
    for tensor in model.tensors:
        unsupported.setdefault(tensor.tensor_type.name, tensor.name)
    unsupported = {t: name for t, name in unsupported.items() if t not in SUPPORTED_TYPES}
    if unsupported:
        listed = ", ".join(f"{t} (e.g. {name})" for t, name in sorted(unsupported.items()))
        raise ConfigError(f"invalid model {model.first}: GGUF tensor types {listed} are not supported; kestrel loads "
                          f"{list(KERNEL_TYPES)} on the weight-only kernel and dequantizes {list(DEQUANTIZED_TYPES)}")


def hf_names(model: GGUFModel, hf_config: dict) -> dict[str, str]:
    """GGUF tensor name -> the checkpoint name of kestrel's model, for every tensor of the file but `ROPE_FREQS`;
    a ConfigError names a tensor the model has no place for."""
    import gguf

    architecture = check_architecture(model.field("general.architecture"))
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    table = gguf.get_tensor_name_map(arch, int(hf_config["num_hidden_layers"]))
    ours = {}
    for name in checkpoint_shapes(hf_config):
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            ours[gguf_name] = name
    stray = [t.name for t in model.tensors if t.name not in ours and t.name != ROPE_FREQS]
    if stray:
        raise ConfigError(f"invalid model {model.first}: GGUF tensors {stray[:5]} have no counterpart in kestrel's "
                          f"{hf_config['architectures'][0]} of this config")
    return ours


def iterate_gguf(model: GGUFModel, hf_config: dict, kernel: dict[str, str],
                 dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `model` under kestrel's checkpoint names: the checkpoint modules of `kernel` (module -> GGML
    type, as `kernel_modules` of the built model says) unpacked for the weight-only kernel, the rest dequantized."""
    names = hf_names(model, hf_config)
    permuted = ARCHITECTURES[model.field("general.architecture")]
    heads = {"q_proj": int(hf_config["num_attention_heads"]),
             "k_proj": int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"])}
    _log_types(model, names, kernel, dtype)
    for tensor in model.tensors:
        if tensor.name == ROPE_FREQS:
            continue
        name = names[tensor.name]
        module, _, kind = name.rpartition(".")
        n_heads = heads.get(module.rpartition(".")[2]) if permuted else None
        if kind == "weight" and module in kernel:
            values, scales = unpack_blocks(tensor)
            yield f"{module}.weight", unpermute_rows(values, n_heads)
            yield f"{module}.weight_scale", unpermute_rows(scales, n_heads)
        else:
            yield name, unpermute_rows(dequantize(tensor), n_heads)


def _log_types(model: GGUFModel, names: dict[str, str], kernel: dict[str, str], dtype: torch.dtype) -> None:
    on_kernel: Counter[str] = Counter()
    dequantized: Counter[str] = Counter()
    for tensor in model.tensors:
        module, _, kind = names.get(tensor.name, "").rpartition(".")
        if kind == "weight" and module in kernel:
            on_kernel[tensor.tensor_type.name] += 1
        elif tensor.tensor_type.name not in ("F32", "F16", "BF16"):
            dequantized[tensor.tensor_type.name] += 1
    parts = []
    if dequantized:
        listed = ", ".join(f"{t} ({n} tensors)" for t, n in sorted(dequantized.items()))
        parts.append(f"{listed} dequantized at load to {str(dtype).removeprefix('torch.')} (no kernel layout, or "
                     "merged with tensors of another type)")
    if on_kernel:
        listed = ", ".join(f"{t} ({n} tensors, W{KERNEL_TYPES[t]}A16)" for t, n in sorted(on_kernel.items()))
        parts.append(f"{listed} on the weight-only kernel")
    if parts:
        logger.info("GGUF %s: %s", model.first.name, "; ".join(parts))


def dequantize(tensor: Any) -> torch.Tensor:
    """The tensor's values as a float32 (or, for F16, float16) torch tensor of its logical shape."""
    import gguf

    data = tensor.data
    if tensor.tensor_type.name in ("F32", "F16"):
        return torch.from_numpy(np.array(data))
    return torch.from_numpy(gguf.quants.dequantize(data, tensor.tensor_type))


def unpack_blocks(tensor: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 or Q4_0 weight's values (int8 [N, K]: q, or c - 8) and scales (float32 [N, K / 32])."""
    type_name = tensor.tensor_type.name
    blocks = np.asarray(tensor.data, dtype=np.uint8)
    rows = blocks.shape[0]
    blocks = blocks.reshape(rows, -1, 2 + GGUF_GROUP * KERNEL_TYPES[type_name] // 8)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 2:]
    if type_name == "Q8_0":
        values = packed.copy().view(np.int8)
    else:
        # Q4_0: byte i holds element i in its low nibble and element i + 16 in its high one.
        values = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8) - np.int8(8)
    return torch.from_numpy(values.reshape(rows, -1)), torch.from_numpy(scales)


def unpermute_rows(tensor: torch.Tensor, n_heads: int | None) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, its rows (2 j + s) back to (s * D / 2 + j)."""
    if n_heads is None:
        return tensor
    rows = tensor.shape[0]
    return tensor.reshape(n_heads, rows // n_heads // 2, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)
