"""A tiny random Qwen2-Audio checkpoint written by transformers itself for the audio tests: a 2-layer Whisper-style
audio encoder on 1-second windows of 16 mel bins (100 frames: at most 25 audio tokens a clip), a 2-layer Qwen2
decoder, the built-in tokenizer with Qwen2-Audio's audio tokens, and a Qwen2AudioProcessor (a Whisper feature
extractor and its default chat template) saved beside them; and clips generated as WAV bytes."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile
import transformers
from multimodal_checkpoints import save_random_model, tiny_text_config, tokenizer_with

AUDIO_TOKEN = "<|AUDIO|>"
SAMPLE_RATE = 16000
CHUNK_SECONDS = 1
MEL_BINS = 16


def write_qwen2_audio(path: Path, seed: int = 0) -> Path:
    tokenizer = tokenizer_with(path, [AUDIO_TOKEN, "<|audio_bos|>", "<|audio_eos|>", "<|im_start|>", "<|im_end|>"])
    frames = CHUNK_SECONDS * SAMPLE_RATE // 160
    audio = transformers.Qwen2AudioEncoderConfig(num_mel_bins=MEL_BINS, encoder_layers=2, encoder_attention_heads=4,
                                                 encoder_ffn_dim=64, d_model=32, max_source_positions=frames // 2)
    text = tiny_text_config(transformers.Qwen2Config, tokenizer)
    config = transformers.Qwen2AudioConfig(audio_config=audio, text_config=text,
                                           audio_token_index=tokenizer.convert_tokens_to_ids(AUDIO_TOKEN),
                                           tie_word_embeddings=False)
    save_random_model(transformers.Qwen2AudioForConditionalGeneration, config, path, seed)
    extractor = transformers.WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLE_RATE,
                                                     chunk_length=CHUNK_SECONDS)
    processor = transformers.Qwen2AudioProcessor(feature_extractor=extractor, tokenizer=tokenizer)
    processor.save_pretrained(str(path))
    tokenizer.chat_template = processor.chat_template
    tokenizer.save_pretrained(str(path))
    return path


def clip(seed: int, seconds: float, rate: int = SAMPLE_RATE) -> np.ndarray:
    """A sine chord plus noise, float32 in [-1, 1]."""
    rng = np.random.RandomState(seed)
    t = np.arange(int(seconds * rate)) / rate
    tones = sum(np.sin(2 * np.pi * f * t) for f in rng.uniform(100, 3000, size=3))
    return (0.25 * tones + 0.05 * rng.randn(t.size)).astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = SAMPLE_RATE, fmt: str = "WAV") -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt)
    return buffer.getvalue()
