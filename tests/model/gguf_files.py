"""Tiny GGUF files written with gguf's own writer, for the GGUF tests: a random model of a kestrel tiny checkpoint's
config and tokenizer, stored in llama.cpp's names and layout (q/k rows permuted for Llama, as llama.cpp's converter
does) in the GGML types asked for, and the float weights that file holds by gguf's own dequantizer (the oracle)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from kestrel.quant import gguf_export
from kestrel.quant.gguf_export import gguf_name

# K-quants as random blocks (gguf writes none of them; random 6-bit scales and mins reach every bit of their packing).
_RANDOM_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _random_encoder(rng: np.random.Generator):
    """gguf_export.encode, but K-quants as random blocks of sane scales and a refused type as bytes of its size."""
    def encode(values: np.ndarray, type_name: str) -> tuple[np.ndarray, object]:
        qtype = gguf.GGMLQuantizationType[type_name] if type_name not in ("F32", "F16") else None
        if type_name in _RANDOM_TYPES:
            return gguf_export.random_blocks(rng, *values.shape, type_name), qtype
        if type_name == "IQ4_NL":  # a type kestrel refuses: bytes of the right size are enough
            return rng.integers(0, 256, (values.shape[0], values.shape[1] // 32 * 18), dtype=np.uint8), qtype
        return gguf_export.encode(values, type_name)
    return encode


def write_gguf(path: Path, hf_dir: Path, types: dict[str, str], *, seed: int = 0, split_max_tensors: int = 0,
               architecture: str | None = None, pre: str = "gpt-2") -> Path:
    """A GGUF file at `path` with `hf_dir`'s config and tokenizer and random weights: 2-D tensors in the type
    `types` gives their GGUF name's module ("attn_v", "output", ...) or else `types["default"]`, norms in F32."""
    rng = np.random.default_rng(seed)

    def random_values():
        for hf_name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
            norm = tensor.dim() == 1 and "norm" in gguf_name(hf_name)
            yield hf_name, (1.0 + 0.2 * rng.standard_normal(tensor.shape) if norm
                            else 0.08 * rng.standard_normal(tensor.shape))

    return gguf_export.write_gguf(path, hf_dir, random_values(),
                                  lambda name: types.get(name.split(".")[-2], types["default"]),
                                  encoder=_random_encoder(rng), split_max_tensors=split_max_tensors,
                                  architecture=architecture, pre=pre)


def oracle_state_dict(paths: list[Path], config: dict) -> dict[str, torch.Tensor]:
    """HF name -> float32 weight of what the GGUF files hold, by gguf's own dequantizer (q/k rows put back)."""
    return {name: torch.from_numpy(values) for name, values in gguf_export.dequantized_tensors(paths, config).items()}
