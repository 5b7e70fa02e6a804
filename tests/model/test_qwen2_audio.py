"""Qwen2-Audio against transformers on a tiny random checkpoint it writes (float32): clips decoded from WAV and FLAC
bytes (one at 8 kHz, resampled to the extractor's 16 kHz), the processor's expansion of the audio placeholders,
logits of flat batches mixing a text-only prompt with one-clip and two-clip prompts (clips of different lengths)
within 1e-4, the same with prefill chunks that split a clip's placeholder run, and greedy generation through LLM
identical (also under 8-token chunks); the resampler's band limit."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from test_llava import REL_TOL, PagedBatch, hf_greedy_ids, hf_logits, llm_greedy_ids, request_state

from kestrel import LLM
from kestrel.config import ModelConfig
from kestrel.entrypoints.media import Audio, MediaLimits, decode_audio, resample
from kestrel.loader import load_model
from kestrel.worker.input_batch import CachedRequestState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from audio_checkpoints import SAMPLE_RATE, clip, wav_bytes, write_qwen2_audio  # noqa: E402

SLOT = "<|audio_bos|><|AUDIO|><|audio_eos|>"
PROMPTS = [  # (text, the clips' (seed, seconds, sampling rate))
    (f"<|im_start|>user\n{SLOT}\nwhat is this sound?<|im_end|>\n<|im_start|>assistant\n", [(1, 0.43, SAMPLE_RATE)]),
    ("<|im_start|>user\na prompt with no audio at all<|im_end|>\n<|im_start|>assistant\n", []),
    (f"<|im_start|>user\n{SLOT}then {SLOT}\ncompare them<|im_end|>\n<|im_start|>assistant\n",
     [(2, 0.71, SAMPLE_RATE), (3, 0.25, 8000)]),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_qwen2_audio(tmp_path_factory.mktemp("qwen2-audio"), seed=5)


@pytest.fixture(scope="module")
def hf(checkpoint):
    model = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(str(checkpoint),
                                                                            dtype=torch.float32).eval()
    return model, transformers.AutoProcessor.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint), dtype="float32", max_model_len=256)


def case(index: int) -> tuple[str, list[Audio]]:
    """The prompt and its clips as the server gets them: encoded files, decoded again."""
    text, specs = PROMPTS[index]
    clips = []
    for k, (seed, seconds, rate) in enumerate(specs):
        data = wav_bytes(clip(seed, seconds, rate), rate, fmt="FLAC" if k else "WAV")
        clips.append(decode_audio(data, "clip", MediaLimits()))
    return text, clips


def hf_inputs(processor, text: str, clips: list[Audio]) -> dict[str, torch.Tensor]:
    audio = [resample(c.samples, c.rate, SAMPLE_RATE) for c in clips] or None
    return processor(text=[text], audio=audio, sampling_rate=SAMPLE_RATE, return_tensors="pt")


def kestrel_state(llm: LLM, index: int) -> CachedRequestState:
    return request_state(llm, str(index), *case(index))


def test_placeholder_expansion_matches_the_processor(llm, hf) -> None:
    _, processor = hf
    counts = []
    for index in range(len(PROMPTS)):
        state = kestrel_state(llm, index)
        assert state.token_ids == hf_inputs(processor, *case(index))["input_ids"][0].tolist()
        counts += [item.num_embeds for item in state.media]
    assert counts == [11, 18, 6]  # a token per 40 ms (of 0.43 s, 0.71 s and 0.25 s, plus the extractor's edge frame)


@pytest.mark.parametrize("chunk", [None, 7])
def test_logits_match_transformers_in_a_mixed_batch(llm, hf, checkpoint, chunk) -> None:
    """With `chunk`, every prompt is fed that many tokens a step, so chunks end inside the clips' placeholder runs
    (each clip encoded once)."""
    model_hf, processor = hf
    model = load_model(ModelConfig(model=str(checkpoint), dtype="float32"))
    states = [kestrel_state(llm, i) for i in range(len(PROMPTS))]
    batch = PagedBatch(model, states)
    all_tables = batch.block_tables
    lengths = [len(s.token_ids) for s in states]
    pieces: list[list[torch.Tensor]] = [[] for _ in states]
    while any(s.num_computed_tokens < n for s, n in zip(states, lengths)):
        counts = [min(chunk or n, n - s.num_computed_tokens) for s, n in zip(states, lengths)]
        live = [i for i, c in enumerate(counts) if c]
        batch.states = [states[i] for i in live]
        batch.block_tables = all_tables[live]
        for i, logits in zip(live, batch.step([counts[i] for i in live])):
            pieces[i].append(logits)
    assert batch.encoder.num_items_encoded == 3
    for index, parts in enumerate(pieces):
        ref = hf_logits(model_hf, hf_inputs(processor, *case(index)))
        ours = torch.cat(parts)
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < REL_TOL, f"prompt {index}: relative error {rel:.2e}"


def hf_greedy(hf, index: int) -> list[int]:
    model, processor = hf
    return hf_greedy_ids(model, hf_inputs(processor, *case(index)))


def kestrel_greedy(llm: LLM, indices: list[int]) -> list[list[int]]:
    prompts = [(text, [(c.samples, c.rate) for c in clips]) for text, clips in map(case, indices)]
    return llm_greedy_ids(llm, prompts, "audio")


def test_greedy_matches_transformers_batched_and_chunked(llm, hf, checkpoint) -> None:
    expected = [hf_greedy(hf, i) for i in range(len(PROMPTS))]
    assert kestrel_greedy(llm, [0, 1, 2]) == expected
    chunked = LLM(str(checkpoint), dtype="float32", max_model_len=256, max_num_batched_tokens=8, max_num_seqs=4,
                  enable_prefix_caching=False)
    assert kestrel_greedy(chunked, [0, 1, 2]) == expected
    assert chunked.runner.media_encoder.num_items_encoded == 3


def test_resampling_keeps_the_band_and_drops_what_is_above_it() -> None:
    t8, t16 = np.arange(8000) / 8000, np.arange(16000) / 16000
    up = resample(np.sin(2 * np.pi * 440 * t8).astype(np.float32), 8000, 16000)
    assert up.shape == (16000,)
    assert np.abs(up - np.sin(2 * np.pi * 440 * t16)).max() < 1e-3
    down = resample(np.sin(2 * np.pi * 6000 * t16).astype(np.float32), 16000, 8000)  # above the 4 kHz Nyquist
    assert down.shape == (8000,) and np.abs(down).max() < 1e-3
    kept = resample(np.sin(2 * np.pi * 1000 * t16).astype(np.float32), 16000, 8000)
    assert np.abs(kept - np.sin(2 * np.pi * 1000 * t8)).max() < 1e-3


def test_clip_longer_than_the_extractor_window_is_refused(llm) -> None:
    from kestrel.request import InvalidRequestError

    text, _ = case(0)
    long = Audio(clip(9, 1.5), SAMPLE_RATE)  # the checkpoint's extractor hears 1 s
    with pytest.raises(InvalidRequestError, match="at most 1 s"):
        llm.media.expand(llm.tokenizer.encode(text), [long], "multi_modal_data")
