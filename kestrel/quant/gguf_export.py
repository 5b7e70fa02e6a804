"""A Hugging Face Llama / Qwen2 / Qwen3 checkpoint written as a GGUF file in llama.cpp's names and layout (q/k rows
permuted for Llama, as llama.cpp's converter does), with the `gguf` package's own writer, in the GGML types asked
for: what `kestrel bench ppl --quant-sweep` scores and what the GGUF tests load.

The `gguf` package quantizes Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 but only dequantizes the K-quants, so Q4_K blocks are
encoded here (`quantize_q4_k`, llama.cpp's block layout: per 256 values an fp16 `d` and `dmin`, eight 6-bit
scale / min pairs packed in 12 bytes, 128 bytes of 4-bit codes; value = d * scale * q - dmin * min). The codes are
round-to-nearest from each 32-value sub-block's min and max, without the search over scales that llama.cpp's
quantizer runs; the other K-quants are not written. A row whose length is not a multiple of 256 cannot hold K-quant
blocks: it takes llama.cpp's fallback type (Q4_K -> Q5_0), and a row no block of its type divides is written F16.
The tokenizer must be a byte-level BPE tokenizer.json ("gpt2" in GGUF; `pre` names its pre-tokenizer split, as
llama.cpp's converter does); its token list is padded to the embedding's rows with `[PADi]` tokens, as llama.cpp's
converter pads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import gguf
import numpy as np

# llama.cpp's names.
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                "model.norm.weight": "output_norm.weight"}
LAYER_MODULES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
                 "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
K_QUANT_FALLBACK = {"Q4_K": "Q5_0"}
SUPER_BLOCK = 256

# (float values, GGML type name) -> (the tensor's data, its GGML type or None for F32 / F16 arrays).
Encoder = Callable[[np.ndarray, str], tuple[np.ndarray, object]]
# Random blocks (`random_blocks`): the fp16 fields of each type's block (byte offset -> value) that make its weights
# about 0.01-0.02 in size: d, and where the type has an offset its dmin / m, set to the mean of d * scale * q over
# uniform bytes so that the weights centre on 0.
RANDOM_BLOCK_SCALES: dict[str, dict[int, float]] = {
    "Q8_0": {0: 2e-4}, "Q4_0": {0: 4e-3}, "Q4_1": {0: 4e-3, 2: -3e-2}, "Q5_0": {0: 1e-3},
    "Q5_1": {0: 1e-3, 2: -1.55e-2}, "Q2_K": {80: 2e-3, 82: 3e-3}, "Q3_K": {108: 2e-4},
    "Q4_K": {0: 4e-5, 2: 3e-4}, "Q5_K": {0: 2e-5, 2: 3.1e-4}, "Q6_K": {208: 5e-6},
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_MODULES[module]}.{kind}"


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: within each head, rows (s * D / 2 + j) -> (2 j + s)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permuted_heads(config: dict, hf_name: str) -> int | None:
    """The heads whose rows llama.cpp's converter permutes in this tensor (Llama's q and k), or None."""
    if config["model_type"] != "llama":
        return None
    if ".q_proj." in hf_name:
        return config["num_attention_heads"]
    if ".k_proj." in hf_name:
        return config["num_key_value_heads"]
    return None


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """uint8 Q4_K blocks [rows, cols / 256 * 144] of float `values` [rows, cols] (cols a multiple of 256)."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(-1, 8, 32)  # super-blocks x sub-blocks x values
    lo = np.minimum(x.min(axis=2), 0.0)
    scale = (x.max(axis=2) - lo) / 15.0
    minimum = -lo
    d = scale.max(axis=1) / 63.0
    dmin = minimum.max(axis=1) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    d32, dmin32 = d16.astype(np.float32), dmin16.astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, d32[:, None], out=np.zeros_like(scale), where=d32[:, None] > 0)), 0, 63)
    mn = np.clip(np.rint(np.divide(minimum, dmin32[:, None], out=np.zeros_like(minimum), where=dmin32[:, None] > 0)),
                 0, 63)
    step = (d32[:, None] * sc)[:, :, None]
    offset = (dmin32[:, None] * mn)[:, :, None]
    q = np.clip(np.rint(np.divide(x + offset, step, out=np.zeros_like(x), where=step > 0)), 0, 15).astype(np.uint8)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    packed = np.zeros((x.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    # 64 values a chunk: sub-block 2c in the low nibbles, 2c + 1 in the high ones.
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(x.shape[0], 128)
    blocks = np.concatenate([d16.reshape(-1, 1).view(np.uint8), dmin16.reshape(-1, 1).view(np.uint8), packed, qs],
                            axis=1)
    return blocks.reshape(rows, cols // SUPER_BLOCK * 144)


# Types written: F32 / F16 as arrays, Q4_K encoded here, the rest quantized by the gguf package.
WRITABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K")


def random_blocks(rng: np.random.Generator, rows: int, cols: int, type_name: str) -> np.ndarray:
    """Random uint8 blocks `[rows, cols / block * bytes]` of a quantized type, its fp16 scale fields set
    (`RANDOM_BLOCK_SCALES`): valid weights of no meaning, for tests and benchmarks of the loader and kernels."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset, scale in RANDOM_BLOCK_SCALES[type_name].items():
        blocks[..., offset:offset + 2] = np.float16(scale).reshape(1).view(np.uint8)
    return blocks.reshape(rows, -1)


def stored_type(type_name: str, cols: int) -> str:
    """The type a row of `cols` values is written in: a K-quant's fallback where K-quant blocks cannot hold it,
    F16 where no block of the type divides the row."""
    if type_name in K_QUANT_FALLBACK and cols % SUPER_BLOCK:
        type_name = K_QUANT_FALLBACK[type_name]
    if type_name in ("F32", "F16", "BF16"):
        return type_name
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
    return type_name if cols % block == 0 else "F16"


def encode(values: np.ndarray, type_name: str) -> tuple[np.ndarray, object]:
    """`values` (float32) in GGML type `type_name`: F32 / F16 arrays as they are, Q4_K here, the rest by gguf."""
    if type_name not in WRITABLE:
        raise ValueError(f"GGML type {type_name} is not written here; supported: {', '.join(WRITABLE)}")
    if type_name == "F32":
        return values.astype(np.float32), None
    if type_name == "F16":
        return values.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "Q4_K":
        return quantize_q4_k(values), qtype
    return gguf.quants.quantize(values.astype(np.float32), qtype), qtype


def write_gguf(path: Path, hf_dir: Path, tensors: Iterable[tuple[str, np.ndarray]], type_of: Callable[[str], str],
               *, encoder: Encoder = encode, split_max_tensors: int = 0, architecture: str | None = None,
               pre: str = "gpt-2") -> Path:
    """A GGUF file at `path` with `hf_dir`'s config and tokenizer and the (HF name, float values) `tensors`: each
    2-D tensor in the type `type_of` gives its GGUF name ("blk.0.attn_v.weight", "output.weight", ...; K-quants
    falling back where rows are not a multiple of 256), 1-D ones in F32. `encoder` turns the values into the type."""
    config = json.loads((hf_dir / "config.json").read_text())
    arch = architecture or config["model_type"]
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    _add_config(writer, arch, config)
    _add_tokenizer(writer, hf_dir, config, pre)
    if (config.get("rope_scaling") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    for hf_name, values in tensors:
        name = gguf_name(hf_name)
        heads = permuted_heads(config, hf_name)
        if heads is not None:
            values = llama_permute(values, heads)
        type_name = "F32" if values.ndim == 1 else stored_type(type_of(name), values.shape[-1])
        data, qtype = encoder(values, type_name)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized_tensors(paths: Iterable[Path], config: dict) -> dict[str, np.ndarray]:
    """HF name -> float32 values of what GGUF files written here hold, by gguf's own dequantizer (q/k rows put
    back in Hugging Face's order); llama.cpp's `rope_freqs` (the config's rope_scaling) left out."""
    by_gguf = {}
    for layer in range(config["num_hidden_layers"]):
        for module in LAYER_MODULES:
            for kind in ("weight", "bias"):
                by_gguf[f"blk.{layer}.{LAYER_MODULES[module]}.{kind}"] = f"model.layers.{layer}.{module}.{kind}"
    by_gguf.update({v: k for k, v in GLOBAL_NAMES.items()})
    out = {}
    for path in paths:
        for tensor in gguf.GGUFReader(str(path)).tensors:
            if tensor.name == "rope_freqs.weight":
                continue
            hf_name = by_gguf[tensor.name]
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            heads = permuted_heads(config, hf_name)
            if heads is not None:
                restored = np.empty_like(values)
                restored[llama_permute(np.arange(values.shape[0]), heads)] = values
                values = restored
            out[hf_name] = np.ascontiguousarray(values)
    return out


def _add_config(writer: gguf.GGUFWriter, arch: str, config: dict) -> None:
    writer.add_name(config.get("_name_or_path") or f"{arch} model")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])


def llama3_rope_factors(config: dict) -> np.ndarray:
    """What llama.cpp's converter stores for Llama 3.1's RoPE scaling: each frequency's divisor."""
    scaling = config["rope_scaling"]
    dim = config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / config["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, config: dict, pre: str) -> None:
    """A byte-level BPE tokenizer.json ("gpt2" in GGUF), padded to the embedding's rows; its special tokens, BOS /
    EOS (the first of a list of EOS ids), whether BOS is added (tokenizer_config.json's `add_bos_token`, off where
    unset, as Hugging Face's BPE tokenizers default) and the chat template."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    if tok["model"].get("type") != "BPE":
        raise ValueError(f"{hf_dir}: only byte-level BPE tokenizers are written to GGUF here, not "
                         f"{tok['model'].get('type')!r}")
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    size = max([len(vocab), config.get("vocab_size") or 0, *(a["id"] + 1 for a in tok["added_tokens"])])
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for token, i in vocab.items():
        tokens[i], types[i] = token, gguf.TokenType.NORMAL
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    for add, token_id in ((writer.add_bos_token_id, config.get("bos_token_id")),
                          (writer.add_eos_token_id, config.get("eos_token_id"))):
        if isinstance(token_id, list):
            token_id = token_id[0] if token_id else None
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    if tok_config.get("chat_template"):
        writer.add_chat_template(tok_config["chat_template"])
