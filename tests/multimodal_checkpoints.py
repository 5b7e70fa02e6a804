"""A tiny random LLaVA-1.5 checkpoint written by transformers itself for the multimodal tests: a 3-layer CLIP
vision tower on 28x28 images (4x4 patches of 7 pixels: 16 image tokens), a 2-layer Llama decoder, the built-in
tokenizer with an `<image>` special token, and a LlavaProcessor (a CLIP image processor and a chat template that
renders image parts as `<image>`) saved beside them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image

from kestrel.loader.tokenizer_init import write_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 28
PATCH_SIZE = 7
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2  # the class token is dropped ("default" strategy)
# LLaVA-1.5's template shape: a message's images first (each "<image>\n"), then its text.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}{{ part['text'] + ' ' }}"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)



def tokenizer_with(path: Path, special_tokens: list[str]) -> transformers.PreTrainedTokenizerBase:
    """The test word-level tokenizer written into `path`, with the model's special tokens added."""
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(str(path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens})
    return tokenizer


def tiny_clip_config() -> transformers.CLIPVisionConfig:
    return transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
                                         projection_dim=16)


def tiny_text_config(config_class: type,
                     tokenizer: transformers.PreTrainedTokenizerBase) -> transformers.PretrainedConfig:
    """The 2-layer decoder every tiny multimodal checkpoint puts behind its encoder."""
    return config_class(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)


def save_random_model(model_class: type, config: transformers.PretrainedConfig, path: Path, seed: int) -> None:
    """A model of `config` from `seed`, its weights then pushed far enough from their init that every layer (and
    every image or clip) matters, saved into `path`."""
    torch.manual_seed(seed)
    model = model_class(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    model.eval().save_pretrained(str(path))

def write_llava(path: Path, seed: int = 0) -> Path:
    tokenizer = tokenizer_with(path, [IMAGE_TOKEN])
    vision = tiny_clip_config()
    text = tiny_text_config(transformers.LlamaConfig, tokenizer)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                                      tie_word_embeddings=False)
    save_random_model(transformers.LlavaForConditionalGeneration, config, path, seed)
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                                      crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                            patch_size=PATCH_SIZE, vision_feature_select_strategy="default",
                                            num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(str(path))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


def random_image(seed: int, width: int = 40, height: int = 34) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


# LLaVA-NeXT's tiles are the tower's 28x28 images: a 1x2, 2x1 or 2x2 grid of them, chosen per image by its size.
GRID_PINPOINTS = [[IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE], [2 * IMAGE_SIZE, 2 * IMAGE_SIZE]]


def write_llava_next(path: Path, seed: int = 0) -> Path:
    """The LLaVA-1.5 checkpoint's shapes as a LlavaNextForConditionalGeneration (an `image_newline` embedding and
    anyres tiling on GRID_PINPOINTS) with a LlavaNextProcessor."""
    tokenizer = tokenizer_with(path, [IMAGE_TOKEN])
    vision = tiny_clip_config()
    text = tiny_text_config(transformers.LlamaConfig, tokenizer)
    config = transformers.LlavaNextConfig(vision_config=vision, text_config=text,
                                          image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                                          image_grid_pinpoints=GRID_PINPOINTS, tie_word_embeddings=False)
    save_random_model(transformers.LlavaNextForConditionalGeneration, config, path, seed)
    image_processor = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_grid_pinpoints=GRID_PINPOINTS)
    processor = transformers.LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                                patch_size=PATCH_SIZE, vision_feature_select_strategy="default",
                                                num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(str(path))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


# Qwen2-VL: 4-pixel patches merged 2x2, so the processor resizes each image to multiples of 8 pixels and an image
# of h x w pixels becomes (h / 8) * (w / 8) placeholders; min/max pixels keep the grids small but different.
QWEN_PATCH = 4
QWEN_MERGE = 2
QWEN_IMAGE_PAD = "<|image_pad|>"
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_qwen2_vl(path: Path, seed: int = 0, version: str = "2") -> Path:
    """A Qwen2VLForConditionalGeneration: a 2-block vision transformer (embed dim 32, 4 heads) merging 2x2
    patches onto a 2-layer Qwen2 decoder with M-RoPE sections (2, 3, 3) of its 8 rotary frequencies, and a
    Qwen2VLProcessor with small min/max pixels. `version="2.5"`: a Qwen2_5_VLForConditionalGeneration, its
    3-block tower attending within 16-pixel windows (2x2 merge windows) in all but its last block."""
    tokenizer = tokenizer_with(path, ["<|vision_start|>", QWEN_IMAGE_PAD, "<|vision_end|>", "<|im_start|>",
                                      "<|im_end|>"])
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("<|vision_start|>", QWEN_IMAGE_PAD,
                                                                    "<|vision_end|>")}
    vision = dict(depth=2, embed_dim=32, num_heads=4, mlp_ratio=2, hidden_size=64, patch_size=QWEN_PATCH,
                  temporal_patch_size=2, spatial_merge_size=QWEN_MERGE, in_channels=3)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config_cls, model_cls, processor_class = (
        transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration, "Qwen2VLProcessor")
    if version == "2.5":
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64,
                      patch_size=QWEN_PATCH, temporal_patch_size=2, spatial_merge_size=QWEN_MERGE, in_channels=3,
                      window_size=16, fullatt_block_indexes=[2])
        config_cls, model_cls, processor_class = (
            transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration, "Qwen2_5_VLProcessor")
    config = config_cls(vision_config=vision, text_config=text, image_token_id=ids[QWEN_IMAGE_PAD],
                        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                        tie_word_embeddings=False)
    save_random_model(model_cls, config, path, seed)
    factor = QWEN_PATCH * QWEN_MERGE
    image_processor = transformers.Qwen2VLImageProcessor(
        size={"shortest_edge": 4 * factor * factor, "longest_edge": 40 * factor * factor}, patch_size=QWEN_PATCH,
        merge_size=QWEN_MERGE, temporal_patch_size=2)
    # Saved as its parts: Qwen2VLProcessor also holds a video processor, which needs torchvision.
    image_processor.save_pretrained(str(path))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}))
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


# Gemma 3: a 2-layer SigLIP tower on 32x32 images (8x8 patches of 4 pixels) average-pooled 2x2 onto 16 image tokens,
# and a 2-layer Gemma 3 decoder with one sliding-window layer (window 8: shorter than an image's 16 placeholders, so
# the window cuts into an image's bidirectional run) and one global layer.
GEMMA3_BOI = "<start_of_image>"
GEMMA3_IMAGE = "<image_soft_token>"
GEMMA3_EOI = "<end_of_image>"
GEMMA3_IMAGE_SIZE = 32
GEMMA3_TOKENS_PER_IMAGE = 16
GEMMA3_WINDOW = 8
GEMMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def write_gemma3(path: Path, seed: int = 0) -> Path:
    """A Gemma3ForConditionalGeneration (SigLIP tower, Gemma 3 projector, Gemma 3 decoder) with a Gemma3Processor:
    each `<start_of_image>` of a prompt becomes `\\n\\n<start_of_image>`, 16 `<image_soft_token>`s,
    `<end_of_image>\\n\\n`."""
    names = {"boi_token": GEMMA3_BOI, "image_token": GEMMA3_IMAGE, "eoi_token": GEMMA3_EOI}
    tokenizer_with(path, [GEMMA3_BOI, GEMMA3_IMAGE, GEMMA3_EOI, "<start_of_turn>", "<end_of_turn>"]).save_pretrained(
        str(path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), extra_special_tokens=names)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=GEMMA3_IMAGE_SIZE, patch_size=4,
                                             vision_use_head=False)
    text = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=16, vocab_size=len(tokenizer), max_position_embeddings=512,
        sliding_window=GEMMA3_WINDOW, layer_types=["sliding_attention", "full_attention"],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = transformers.Gemma3Config(
        vision_config=vision, text_config=text, mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
        boi_token_index=tokenizer.convert_tokens_to_ids(GEMMA3_BOI),
        eoi_token_index=tokenizer.convert_tokens_to_ids(GEMMA3_EOI),
        image_token_index=tokenizer.convert_tokens_to_ids(GEMMA3_IMAGE))
    save_random_model(transformers.Gemma3ForConditionalGeneration, config, path, seed)
    image_processor = transformers.Gemma3ImageProcessorPil(
        size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE})
    processor = transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                             image_seq_length=GEMMA3_TOKENS_PER_IMAGE,
                                             chat_template=GEMMA3_CHAT_TEMPLATE)
    processor.save_pretrained(str(path))
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path
