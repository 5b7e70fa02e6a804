"""Whisper (encoder-decoder) against transformers on a tiny random checkpoint it writes (float32): clips of different
lengths (one at 8 kHz, resampled) with different forced decoder prompts (language, task, timestamps or not, a
previous-text prompt) in one batch. The decoder's logits, fed through the worker's seams (block tables of a full
self-attention group and a cross-attention group, the encoder step writing the cross K/V once, prefill in chunks)
within 1e-4 of transformers'; greedy generation through LLM identical to transformers' `generate` with the same
forced tokens, batched and chunked; one encoder pass per distinct clip; requests without exactly one clip refused."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from kestrel import LLM, SamplingParams
from kestrel.config import ConfigError, ModelConfig
from kestrel.entrypoints.media import Audio, MediaLimits, decode_audio, resample
from kestrel.kv_spec import CrossAttentionSpec, FullAttentionSpec
from kestrel.loader import load_model
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import SamplingParams as Params
from kestrel.worker.input_batch import BlockTables, CachedRequestState, build_model_inputs
from kestrel.worker.kv_cache import KVCacheShape, kv_cache_groups
from kestrel.worker.media_encoder import MediaEncoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from audio_checkpoints import SAMPLE_RATE, clip, wav_bytes, write_whisper  # noqa: E402

REL_TOL = 1e-4
BLOCK_SIZE = 8
MAX_NEW = 10
# (clip seed, seconds, sampling rate), the decoder prompt's tokens
CASES = [
    ((1, 0.6, SAMPLE_RATE), ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]),
    ((2, 0.3, 8000), ["<|startoftranscript|>", "<|de|>", "<|translate|>", "<|notimestamps|>"]),
    ((3, 1.0, SAMPLE_RATE), ["<|startoftranscript|>", "<|fr|>", "<|transcribe|>", "<|0.00|>"]),
    ((4, 0.45, SAMPLE_RATE), ["<|startofprev|>", "the last words", "<|startoftranscript|>", "<|en|>",
                              "<|transcribe|>", "<|notimestamps|>"]),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_whisper(tmp_path_factory.mktemp("whisper"), seed=3)


@pytest.fixture(scope="module")
def hf(checkpoint):
    model = transformers.WhisperForConditionalGeneration.from_pretrained(str(checkpoint),
                                                                         dtype=torch.float32).eval()
    return model, transformers.WhisperFeatureExtractor.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint), dtype="float32", max_num_seqs=8)


def case(llm: LLM, index: int, through_file: bool = True) -> tuple[list[int], Audio]:
    """The forced tokens (special tokens and text) and the clip as the server gets it: a file, decoded again
    (`through_file=False`: the samples themselves, for hosts without the server's audio decoder)."""
    (seed, seconds, rate), tokens = CASES[index]
    samples = clip(seed, seconds, rate)
    audio = decode_audio(wav_bytes(samples, rate), "file", MediaLimits()) if through_file else Audio(samples, rate)
    tokenizer = llm.tokenizer
    ids = [i for token in tokens for i in ([tokenizer.convert_tokens_to_ids(token)] if token.startswith("<|")
                                           else tokenizer.encode(token, add_special_tokens=False))]
    return ids, audio


def hf_features(extractor, audio: Audio) -> torch.Tensor:
    samples = resample(audio.samples, audio.rate, SAMPLE_RATE)
    return extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="pt")["input_features"]


def test_logits_match_transformers_through_the_worker_seams(llm, hf, checkpoint) -> None:
    model_hf, extractor = hf
    model = load_model(ModelConfig(model=str(checkpoint), dtype="float32"))
    layers = model.attention_layers()
    shape = KVCacheShape.of_layers(layers, torch.float32, BLOCK_SIZE)
    groups, layer_groups = kv_cache_groups(shape.layer_specs)
    assert [type(g.spec) for g in groups] == [FullAttentionSpec, CrossAttentionSpec]
    cross_blocks = groups[1].spec.num_blocks_per_request(BLOCK_SIZE)
    num_blocks = 64
    for layer, group in zip(layers, layer_groups):
        layer.bind_kv_cache(torch.zeros(2, num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_size), group=group)
    # Each request: its forced tokens, then transformers' own greedy continuation fed back as the prompt.
    tables = BlockTables(len(CASES), 16, (True, False))
    states, features = [], []
    free = iter(range(1, num_blocks))
    encoder = MediaEncoder(model, cache_rows=4096)
    for index in range(len(CASES)):
        forced, audio = case(llm, index)
        feats = hf_features(extractor, audio)
        with torch.no_grad():
            out = transformers.GenerationMixin.generate(
                model_hf, input_features=feats, decoder_input_ids=torch.tensor([forced]), max_new_tokens=6,
                do_sample=False, eos_token_id=None, pad_token_id=0)
        ids, media = llm.media.expand(out[0].tolist(), [audio], "multi_modal_data")
        blocks = [[next(free) for _ in range(-(-len(ids) // BLOCK_SIZE))], [next(free) for _ in range(cross_blocks)]]
        state = CachedRequestState(str(index), ids, len(ids), Params(), blocks, 0, media=media)
        state.block_table_row = tables.add(blocks)
        states.append(state)
        features.append(feats)
    pieces: list[list[torch.Tensor]] = [[] for _ in states]
    while any(s.num_computed_tokens < len(s.token_ids) for s in states):
        live = [s for s in states if s.num_computed_tokens < len(s.token_ids)]
        counts = [min(5, len(s.token_ids) - s.num_computed_tokens) for s in live]
        inputs = build_model_inputs(live, counts, BLOCK_SIZE, torch.device("cpu"), tables)
        encoder.write_cross_kv(live)
        with torch.no_grad():
            hidden = model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        logits = model.compute_logits(hidden)
        offset = 0
        for s, count in zip(live, counts):
            pieces[states.index(s)].append(logits[offset: offset + count])
            offset += count
            s.num_computed_tokens += count
    assert encoder.num_items_encoded == len(CASES) and encoder.num_encoder_calls == 1
    for index, (state, feats) in enumerate(zip(states, features)):
        with torch.no_grad():
            ref = model_hf(input_features=feats, decoder_input_ids=torch.tensor([state.token_ids])).logits[0]
        ours = torch.cat(pieces[index])
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < REL_TOL, f"case {index}: relative error {rel:.2e}"


def hf_greedy(hf, forced: list[int], audio: Audio) -> list[int]:
    model, extractor = hf
    with torch.no_grad():
        out = transformers.GenerationMixin.generate(
            model, input_features=hf_features(extractor, audio), decoder_input_ids=torch.tensor([forced]),
            max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(forced):].tolist()


def kestrel_greedy(llm: LLM, cases: list[tuple[list[int], Audio]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = [{"prompt_token_ids": forced, "multi_modal_data": {"audio": (audio.samples, audio.rate)}}
               for forced, audio in cases]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_matches_transformers_generate_batched_and_chunked(llm, hf, checkpoint) -> None:
    cases = [case(llm, i) for i in range(len(CASES))]
    expected = [hf_greedy(hf, *c) for c in cases]
    assert len({tuple(e) for e in expected}) > 1  # the clips and prompts lead different ways
    assert kestrel_greedy(llm, cases) == expected
    # Again in another order, and the first clip twice: the encoder cache serves the repeats.
    encoder = llm.engine.runner.media_encoder
    before = encoder.num_items_encoded
    assert kestrel_greedy(llm, [cases[2], cases[0], cases[0]]) == [expected[2], expected[0], expected[0]]
    assert encoder.num_items_encoded == before
    # A text prompt is the decoder prompt with its special tokens written out; the tokenizer adds none.
    text = {"prompt": "".join(CASES[1][1]), "multi_modal_data": {"audio": (cases[1][1].samples, cases[1][1].rate)}}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    assert list(llm.generate(text, params, use_tqdm=False)[0].outputs[0].token_ids) == expected[1]
    chunked = LLM(str(checkpoint), dtype="float32", max_num_seqs=2, max_num_batched_tokens=3,
                  enable_prefix_caching=False)
    assert kestrel_greedy(chunked, cases) == expected


def test_a_request_needs_exactly_one_clip(llm) -> None:
    forced, audio = case(llm, 0)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError) as error:
        llm.generate({"prompt_token_ids": forced}, params, use_tqdm=False)
    assert error.value.param == "multi_modal_data"
    two = {"prompt_token_ids": forced, "multi_modal_data": {"audio": [(audio.samples, audio.rate)] * 2}}
    with pytest.raises(InvalidRequestError, match="exactly one audio clip") as error:
        llm.generate(two, params, use_tqdm=False)
    assert error.value.param == "multi_modal_data"
    long = {"prompt_token_ids": forced, "multi_modal_data": {"audio": (np.zeros(SAMPLE_RATE * 2, np.float32),
                                                                       SAMPLE_RATE)}}
    with pytest.raises(InvalidRequestError, match="at most 1 s"):
        llm.generate(long, params, use_tqdm=False)


@pytest.mark.parametrize("flag, value", [("debug_launch_count", True), ("quantization", "fp8")])
def test_unsupported_engine_settings_are_refused(checkpoint, flag, value) -> None:
    with pytest.raises(ConfigError, match=flag.split("_")[0]):
        LLM(str(checkpoint), dtype="float32", **{flag: value})
