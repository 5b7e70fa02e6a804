"""A GGUF model's tensors as (Hugging Face name, tensor) pairs for `load_weights`.

Names: llama.cpp's (`blk.0.attn_q.weight`) mapped to the checkpoint names of kestrel's model (`model.layers.0.
self_attn.q_proj.weight`) by inverting gguf's own table (`gguf.get_tensor_name_map`) over the model's tensor names.
llama.cpp's converter reorders the rows of Llama's q and k projections within each head (from the half-split RoPE
layout to the interleaved one its kernels use); they are put back as transformers' GGUF loader does.

Values: the tensors of layers on the weight-only kernel (`kestrel.quant.schemes.gguf`) are unpacked from their blocks
into its int-quantized layout in the layer's form (`weight` int8 [N, K], `weight_scale` float32 [N, K / group],
`weight_min` float32 where the layer has offsets); every other tensor (float types, the embedding and the LM head, a
layer with a float part) is dequantized to float32, one tensor at a time, and the model's loader rounds it to the
model dtype. Both run in torch (`kestrel.quant.gguf_blocks`) on the device the model is built on: each tensor's
blocks are copied there once, as bytes.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kestrel.config import ConfigError
from kestrel.loader.gguf_files import GGUFModel
from kestrel.loader.model_init import checkpoint_shapes
from kestrel.quant import gguf_blocks
from kestrel.quant.gguf_blocks import FORMS, BlockForm

logger = logging.getLogger(__name__)

# GGUF architecture -> whether llama.cpp's converter permuted its q/k rows (LlamaModel.permute).
ARCHITECTURES: dict[str, bool] = {"llama": True, "qwen2": False, "qwen3": False}
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = (*FLOAT_TYPES, *FORMS)
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
                          f"{list(FLOAT_TYPES)} and {list(FORMS)}")


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


def iterate_gguf(model: GGUFModel, hf_config: dict, kernel: dict[str, BlockForm], dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `model` under kestrel's checkpoint names, on `device`: the checkpoint modules of `kernel`
    (module -> its layer's kernel form, as `kernel_modules` of the built model says) unpacked for the weight-only
    kernel, the rest dequantized."""
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
            form = kernel[module]
            type_name = tensor.tensor_type.name
            values, scales, mins = gguf_blocks.to_form(gguf_blocks.unpack(blocks_of(tensor, device), type_name),
                                                      type_name, form)
            yield f"{module}.weight", unpermute_rows(values, n_heads)
            yield f"{module}.weight_scale", unpermute_rows(scales, n_heads)
            if mins is not None:
                yield f"{module}.weight_min", unpermute_rows(mins, n_heads)
        else:
            yield name, unpermute_rows(dequantize(tensor, device), n_heads)


def _log_types(model: GGUFModel, names: dict[str, str], kernel: dict[str, BlockForm], dtype: torch.dtype) -> None:
    on_kernel: Counter[tuple[str, int]] = Counter()
    dequantized: Counter[str] = Counter()
    for tensor in model.tensors:
        module, _, kind = names.get(tensor.name, "").rpartition(".")
        if kind == "weight" and module in kernel:
            on_kernel[tensor.tensor_type.name, kernel[module].bits] += 1
        elif tensor.tensor_type.name not in FLOAT_TYPES:
            dequantized[tensor.tensor_type.name] += 1
    parts = []
    if dequantized:
        listed = ", ".join(f"{t} ({n} tensors)" for t, n in sorted(dequantized.items()))
        parts.append(f"{listed} dequantized at load to {str(dtype).removeprefix('torch.')} (embedding, LM head, or "
                     "merged with a float tensor)")
    if on_kernel:
        listed = ", ".join(f"{t} ({n} tensors, W{bits}A16)" for (t, bits), n in sorted(on_kernel.items()))
        parts.append(f"{listed} on the weight-only kernel")
    if parts:
        logger.info("GGUF %s: %s", model.first.name, "; ".join(parts))


def dequantize(tensor: Any, device: str | torch.device = "cpu") -> torch.Tensor:
    """The tensor's values on `device` as a float32 (F16: float16) torch tensor of its logical shape."""
    import gguf

    type_name = tensor.tensor_type.name
    if type_name in ("F32", "F16"):
        return torch.from_numpy(np.array(tensor.data)).to(device)
    if type_name == "BF16":
        return torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).to(device)
    return gguf_blocks.dequantize(blocks_of(tensor, device), type_name)


def blocks_of(tensor: Any, device: str | torch.device) -> torch.Tensor:
    """A quantized tensor's blocks as uint8 `[rows, bytes]` on `device`."""
    blocks = np.asarray(tensor.data, dtype=np.uint8)
    with warnings.catch_warnings():
        # The reader's arrays are read-only views of the file; these bytes are only ever read.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(blocks.reshape(blocks.shape[0], -1)).to(device)


def unpermute_rows(tensor: torch.Tensor, n_heads: int | None) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, its rows (2 j + s) back to (s * D / 2 + j)."""
    if n_heads is None:
        return tensor
    rows = tensor.shape[0]
    return tensor.reshape(n_heads, rows // n_heads // 2, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)
