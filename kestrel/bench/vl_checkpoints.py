"""Random-weight vision-language checkpoints for `kestrel bench multimodal`: a LLaVA-1.5-7B shape (CLIP ViT-L/14 at 336
pixels, a 2-layer MLP projector, a Llama-2-7B decoder with a 32,064-token vocabulary) and a Qwen2.5-VL-7B shape (its
32-block windowed vision transformer, a Qwen2 7B decoder with M-RoPE), each with the processor and tokenizer files the
engine loads (and, for the CPU smoke run beside them, a Qwen2-VL-7B shape: its 32-block tower of full attention);
`tiny=True` gives the same architectures at test sizes.

The weights are drawn on the given device in the checkpoint's dtype (normal, std 0.02; norm weights 1 + that) by
walking the parameter names and shapes of the transformers model built on the meta device, so a 7B checkpoint takes
seconds on a GPU. The tokenizer is a word-level one of the published vocabulary's size whose special tokens sit at
the published ids (prompts are random token ids; only the special tokens are ever encoded from text).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kestrel.loader.model_init import _write_weights

LLAVA_IMAGE_TOKEN = "<image>"
QWEN_IMAGE_TOKEN = "<|image_pad|>"
# Qwen2's special tokens in their published order, from id 151,643 (the tiny vocabulary puts them after its words).
QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                       "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                       "<|vision_end|>", "<|vision_pad|>", QWEN_IMAGE_TOKEN, "<|video_pad|>"]
WEIGHT_STD = 0.02
SPEC_FILE = "kestrel-bench-spec.json"

# The published config.json shapes (llava-hf/llava-1.5-7b-hf and Qwen/Qwen2.5-VL-7B-Instruct); `tiny`: test sizes.
SHAPES: dict[str, dict[str, Any]] = {
    "llava-1.5-7b": {
        "family": "llava", "base_vocab": 32000, "vocab_size": 32064,
        "vision": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                   "image_size": 336, "patch_size": 14, "projection_dim": 768, "hidden_act": "quick_gelu",
                   "layer_norm_eps": 1e-5},
        "text": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                 "rope_theta": 10000.0},
        "tiny": {"base_vocab": 500, "vocab_size": 512,
                 "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
                            "num_attention_heads": 4, "image_size": 28, "patch_size": 7, "projection_dim": 16},
                 "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}},
    },
    "qwen2.5-vl-7b": {
        "family": "qwen2.5-vl", "base_vocab": 151643, "vocab_size": 152064,
        "vision": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                   "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                   "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu",
                   "in_channels": 3, "tokens_per_second": 2},
        "text": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                 "num_key_value_heads": 4, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}},
        # the processor's area bounds in pixels (min_pixels / max_pixels)
        "pixels": [3136, 12845056],
        "tiny": {"base_vocab": 500, "vocab_size": 520, "pixels": [256, 2560],
                 "vision": {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 4,
                            "out_hidden_size": 64, "patch_size": 4, "window_size": 16, "fullatt_block_indexes": [2]},
                 "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                              "mrope_section": [2, 3, 3]}}},
    },
    "qwen2-vl-7b": {
        "family": "qwen2-vl", "base_vocab": 151643, "vocab_size": 152064,
        "vision": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4, "num_heads": 16,
                   "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "hidden_act": "quick_gelu",
                   "in_channels": 3},
        "text": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                 "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}},
        "pixels": [3136, 12845056],
        "tiny": {"base_vocab": 500, "vocab_size": 520, "pixels": [256, 2560],
                 "vision": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2, "num_heads": 4,
                            "patch_size": 4},
                 "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                              "mrope_section": [2, 3, 3]}}},
    },
}
# family -> (config class, model class, processor class), by name in transformers
QWEN_CLASSES = {"qwen2-vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
                "qwen2.5-vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor")}


def shape_of(arch: str, tiny: bool) -> dict[str, Any]:
    """The architecture's shape, its test sizes laid over it when `tiny`."""
    base = {k: v for k, v in SHAPES[arch].items() if k != "tiny"}
    if not tiny:
        return base
    small = SHAPES[arch]["tiny"]
    return {**base, **{k: v for k, v in small.items() if k not in ("vision", "text")},
            "vision": {**base["vision"], **small["vision"]}, "text": {**base["text"], **small["text"]}}


def write_checkpoint(path: Path, arch: str, device: torch.device, dtype: torch.dtype, tiny: bool = False,
                     seed: int = 0) -> Path:
    """The random checkpoint of `arch` in `path` (reused when an earlier run wrote the same spec there)."""
    import transformers

    shape = shape_of(arch, tiny)
    spec = {"arch": arch, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "seed": seed,
            "std": WEIGHT_STD}
    marker = path / SPEC_FILE
    if marker.is_file() and json.loads(marker.read_text()) == spec and any(path.glob("*.safetensors")):
        return path
    marker.unlink(missing_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    if shape["family"] == "llava":
        tokenizer = filler_tokenizer(shape["base_vocab"], shape["vocab_size"], ["<unk>", "<s>", "</s>"],
                                     [LLAVA_IMAGE_TOKEN, "<pad>"], bos="<s>", eos="</s>", unk="<unk>", pad="<pad>")
        config, model_class = llava_config(shape, tokenizer), transformers.LlavaForConditionalGeneration
    else:
        tokenizer = filler_tokenizer(shape["base_vocab"], shape["vocab_size"], [], QWEN_SPECIAL_TOKENS, bos=None,
                                     eos="<|im_end|>", unk=None, pad="<|endoftext|>")
        config = qwen_vl_config(shape, tokenizer)
        model_class = getattr(transformers, QWEN_CLASSES[shape["family"]][1])
    config.dtype = dtype
    config.architectures = [model_class.__name__]
    tensors = random_tensors(model_class, config, device, dtype, seed)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_weights(path, tensors, num_shards=max(1, total // (4 << 30)))
    tensors.clear()
    config.save_pretrained(str(path))
    save_processor(path, shape, tokenizer)
    marker.write_text(json.dumps(spec, indent=2) + "\n")
    return path


def random_tensors(model_class: type, config: Any, device: torch.device, dtype: torch.dtype,
                   seed: int) -> dict[str, torch.Tensor]:
    """Every saved tensor of `model_class(config)` (names and shapes from a meta-device instance), drawn on `device`
    and moved to the host one at a time."""
    with torch.device("meta"):
        model = model_class(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    del model
    gen = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        values = torch.empty(shape, device=device, dtype=dtype)
        # 1-D weights are norm scales: around 1, as trained ones are, so that activations keep their size.
        values.normal_(1.0 if len(shape) == 1 and name.endswith(".weight") else 0.0, WEIGHT_STD, generator=gen)
        tensors[name] = values.cpu()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the engine sizes its KV cache from free device memory
    return tensors


def filler_tokenizer(base_vocab: int, vocab_size: int, first_words: list[str], specials: list[str], bos: str | None,
                     eos: str, unk: str | None, pad: str) -> Any:
    """A word-level tokenizer of `base_vocab` words (`first_words`, then `w<id>`) followed by `specials`, so that each
    special token has the id the published vocabulary gives it, then `<extra_<id>>` words up to the model's
    `vocab_size` (random weights sample the published checkpoints' padding rows too, and every id must decode)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = first_words + [f"w{i}" for i in range(len(first_words), base_vocab)]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=unk or words[0]))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.add_special_tokens(specials)
    raw.add_tokens([f"<extra_{i}>" for i in range(base_vocab + len(specials), vocab_size)])
    named = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, **{k: v for k, v in named.items() if v is not None})
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in named.values()]})
    return tokenizer


def llava_config(shape: dict[str, Any], tokenizer: Any) -> Any:
    import transformers

    vision = transformers.CLIPVisionConfig(**shape["vision"])
    text = transformers.LlamaConfig(**shape["text"], vocab_size=shape["vocab_size"],
                                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.pad_token_id)
    return transformers.LlavaConfig(vision_config=vision, text_config=text,
                                    image_token_index=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
                                    pad_token_id=tokenizer.pad_token_id, vision_feature_layer=-2,
                                    vision_feature_select_strategy="default", tie_word_embeddings=False)


def qwen_vl_config(shape: dict[str, Any], tokenizer: Any) -> Any:
    """Qwen2-VL's or Qwen2.5-VL's config (the same decoder and special tokens; their towers differ)."""
    import transformers

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    text = dict(shape["text"], vocab_size=shape["vocab_size"], bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"])
    return getattr(transformers, QWEN_CLASSES[shape["family"]][0])(
        vision_config=shape["vision"], text_config=text, image_token_id=ids[QWEN_IMAGE_TOKEN],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def save_processor(path: Path, shape: dict[str, Any], tokenizer: Any) -> None:
    """The checkpoint's processor files: LLaVA's processor (CLIP image processor at the tower's size), or Qwen2(.5)-VL's
    image processor and processor class (saved as parts: its processor also holds a video processor, which needs
    torchvision) beside the tokenizer."""
    import transformers

    vision = shape["vision"]
    if shape["family"] == "llava":
        size = vision["image_size"]
        image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": size},
                                                          crop_size={"height": size, "width": size})
        processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                                patch_size=vision["patch_size"], num_additional_image_tokens=1,
                                                vision_feature_select_strategy="default")
        processor.save_pretrained(str(path))
        tokenizer.save_pretrained(str(path))
        return
    min_pixels, max_pixels = shape["pixels"]
    image_processor = transformers.Qwen2VLImageProcessor(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=vision["patch_size"],
        merge_size=vision["spatial_merge_size"], temporal_patch_size=vision["temporal_patch_size"])
    image_processor.save_pretrained(str(path))
    processor_class = QWEN_CLASSES[shape["family"]][2]
    (path / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}) + "\n")
    tokenizer.save_pretrained(str(path))
