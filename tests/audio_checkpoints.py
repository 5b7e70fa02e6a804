"""A tiny random Qwen2-Audio checkpoint written by transformers itself for the audio tests: a 2-layer Whisper-style
audio encoder on 1-second windows of 16 mel bins (100 frames: at most 25 audio tokens a clip), a 2-layer Qwen2
decoder, the built-in tokenizer with Qwen2-Audio's audio tokens, and a Qwen2AudioProcessor (a Whisper feature
extractor and its default chat template) saved beside them; and clips generated as WAV bytes."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
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
    import soundfile  # the server's audio decoder; GPU hosts that run the offline tests may lack it

    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt)
    return buffer.getvalue()


# Whisper's special tokens, in the published vocabularies' order after the text tokens; the timestamp tokens
# `<|0.00|>` .. `<|1.00|>` (steps of 20 ms over the tiny model's 1 s window) come last.
WHISPER_LANGUAGES = ("en", "de", "fr")
WHISPER_SPECIALS = ("<|endoftext|>", "<|startoftranscript|>", *(f"<|{lang}|>" for lang in WHISPER_LANGUAGES),
                    "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                    "<|notimestamps|>")
WHISPER_TIMESTAMPS = tuple(f"<|{i * 0.02:.2f}|>" for i in range(51))
WHISPER_MAX_TARGET = 64


def write_whisper(path: Path, seed: int = 0) -> Path:
    """A tiny random WhisperForConditionalGeneration: a 2-layer encoder and a 2-layer decoder (d_model 64, heads of
    16, the Triton attention kernel's smallest) on 1-second windows of 16 mel bins (50 encoder positions), the test
    tokenizer with Whisper's special and timestamp tokens, a WhisperFeatureExtractor and a generation_config.json with
    the language and task tables."""
    tokenizer = tokenizer_with(path, [*WHISPER_SPECIALS, *WHISPER_TIMESTAMPS])
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in WHISPER_SPECIALS}
    frames = CHUNK_SECONDS * SAMPLE_RATE // 160
    config = transformers.WhisperConfig(
        vocab_size=len(tokenizer), num_mel_bins=MEL_BINS, encoder_layers=2, encoder_attention_heads=4,
        decoder_layers=2, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, d_model=64,
        max_source_positions=frames // 2, max_target_positions=WHISPER_MAX_TARGET,
        pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|endoftext|>"],
        decoder_start_token_id=ids["<|startoftranscript|>"], suppress_tokens=[], begin_suppress_tokens=[],
        init_std=0.1)  # large enough weights that each clip leads the greedy text its own way
    save_random_model(transformers.WhisperForConditionalGeneration, config, path, seed)
    generation = transformers.GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"], no_timestamps_token_id=ids["<|notimestamps|>"],
        lang_to_id={f"<|{lang}|>": ids[f"<|{lang}|>"] for lang in WHISPER_LANGUAGES},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        is_multilingual=True, max_length=WHISPER_MAX_TARGET)
    generation.save_pretrained(str(path))
    extractor = transformers.WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLE_RATE,
                                                     chunk_length=CHUNK_SECONDS)
    extractor.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def separate_languages(path: Path, clips: list[np.ndarray]) -> Path:
    """Rewrite a tiny Whisper's language-token embeddings (tied to its LM head) so that language detection tells
    clips apart: the row of WHISPER_LANGUAGES[i] becomes clip i's decoder state after <|startoftranscript|> less
    the clips' mean, scaled to norm 20 (a random model otherwise reads every clip as one language)."""
    model = transformers.WhisperForConditionalGeneration.from_pretrained(str(path)).eval()
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(str(path))
    start = torch.tensor([[model.generation_config.decoder_start_token_id]])
    with torch.no_grad():
        states = torch.stack([model.model(input_features=extractor(c, sampling_rate=SAMPLE_RATE,
                                                                   return_tensors="pt")["input_features"],
                                          decoder_input_ids=start).last_hidden_state[0, -1] for c in clips])
        centered = states - states.mean(0)
        weight = model.model.decoder.embed_tokens.weight
        for language, row in zip(WHISPER_LANGUAGES, centered):
            weight[model.generation_config.lang_to_id[f"<|{language}|>"]] = 20 * row / row.norm()
    model.save_pretrained(str(path))
    return path
