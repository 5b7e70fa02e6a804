"""LLaVA-NeXT against transformers on a tiny random checkpoint it writes (float32; anyres tiles on 1x2, 2x1 and 2x2
grids): the processor's image-size-dependent expansion of the placeholders, the encoder's features of images of
different aspect ratios encoded in one pass, logits of flat batches mixing text-only, wide, tall and squarish images
within 1e-4 (also with prefill chunks that split an image's placeholder run), and greedy generation through LLM
identical (also under 8-token chunks). The config checks refuse what the tiling cannot lay out."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from test_llava import REL_TOL, PagedBatch, hf_greedy_ids, hf_logits, llm_greedy_ids, request_state

from kestrel import LLM
from kestrel.config import ConfigError, ModelConfig
from kestrel.loader import load_model
from kestrel.worker.input_batch import CachedRequestState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from multimodal_checkpoints import IMAGE_TOKEN, random_image, write_llava_next  # noqa: E402

WIDE, TALL, SQUARISH = (90, 20), (20, 90), (40, 34)  # (width, height): 1x2, 2x1 and 2x2 tile grids
PROMPTS = [  # (text, image sizes)
    (f"USER: {IMAGE_TOKEN}\nwhat is in the picture? ASSISTANT:", [SQUARISH]),
    ("USER: a prompt with no image at all ASSISTANT:", []),
    (f"USER: {IMAGE_TOKEN}\n{IMAGE_TOKEN}\ncompare these two ASSISTANT:", [WIDE, TALL]),
]


def case(index: int) -> tuple[str, list]:
    text, sizes = PROMPTS[index]
    return text, [random_image(10 * index + k, width=w, height=h) for k, (w, h) in enumerate(sizes)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_llava_next(tmp_path_factory.mktemp("llava-next"), seed=5)


@pytest.fixture(scope="module")
def hf(checkpoint):
    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32)
    return model.eval(), transformers.AutoProcessor.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint), dtype="float32", max_model_len=512)


def hf_inputs(processor, index: int) -> dict[str, torch.Tensor]:
    text, images = case(index)
    return processor(text=text, images=images or None, return_tensors="pt")


def kestrel_state(llm: LLM, index: int) -> CachedRequestState:
    return request_state(llm, str(index), *case(index))


def test_placeholder_expansion_matches_the_processor_and_depends_on_the_image_size(llm, hf) -> None:
    _, processor = hf
    counts = []
    for index in range(len(PROMPTS)):
        state = kestrel_state(llm, index)
        assert state.token_ids == hf_inputs(processor, index)["input_ids"][0].tolist()
        counts += [item.num_embeds for item in state.media]
    assert len(set(counts)) == 3, counts  # wide, tall and squarish images expand differently


def test_image_features_of_different_aspect_ratios_in_one_pass(llm, hf, checkpoint) -> None:
    model_hf, processor = hf
    model = load_model(ModelConfig(model=str(checkpoint), dtype="float32"))
    images = [random_image(k, width=w, height=h) for k, (w, h) in enumerate((WIDE, TALL, SQUARISH))]
    processed = processor.image_processor(images, return_tensors="pt")
    with torch.no_grad():
        expected = model_hf.model.get_image_features(processed["pixel_values"], processed["image_sizes"]).pooler_output
        ours = model.embed_multimodal("image", [
            {key: value[i: i + 1] for key, value in processed.items()} for i in range(len(images))])
    for ref, got in zip(expected, ours, strict=True):
        assert got.shape == ref.shape
        assert (got - ref).abs().max() / ref.abs().max() < REL_TOL


@pytest.mark.parametrize("chunk", [None, 8, 5])
def test_logits_match_transformers_in_a_mixed_batch(llm, hf, checkpoint, chunk) -> None:
    """Squarish-image, text-only and wide + tall prompts in one flat batch; with `chunk`, chunks end inside the
    images' placeholder runs (each image still encoded once)."""
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
        batch.states, batch.block_tables = [states[i] for i in live], all_tables[live]
        for i, logits in zip(live, batch.step([counts[i] for i in live])):
            pieces[i].append(logits)
    assert batch.encoder.num_items_encoded == 3
    for index, parts in enumerate(pieces):
        ref = hf_logits(model_hf, hf_inputs(processor, index))
        rel = (torch.cat(parts) - ref).abs().max() / ref.abs().max()
        assert rel < REL_TOL, f"prompt {index}: relative error {rel:.2e}"


def kestrel_greedy(llm: LLM, indices: list[int]) -> list[list[int]]:
    return llm_greedy_ids(llm, [case(i) for i in indices], "image")


def test_greedy_matches_transformers_batched_and_chunked(llm, hf, checkpoint) -> None:
    model_hf, processor = hf
    expected = [hf_greedy_ids(model_hf, hf_inputs(processor, index)) for index in range(len(PROMPTS))]
    assert kestrel_greedy(llm, [0, 1, 2]) == expected
    chunked = LLM(str(checkpoint), dtype="float32", max_model_len=512, max_num_batched_tokens=8, max_num_seqs=4,
                  enable_prefix_caching=False)
    assert kestrel_greedy(chunked, [0, 1, 2]) == expected
    assert chunked.runner.media_encoder.num_items_encoded == 3


@pytest.mark.parametrize(("field", "value", "words"), [
    ("vision_feature_select_strategy", "full", "class token dropped"),
    ("image_grid_pinpoints", [[28, 50]], "not a grid"),
    ("image_grid_pinpoints", [28, 56], "height, width"),
])
def test_configs_the_tiling_cannot_lay_out_are_refused(checkpoint, tmp_path, field, value, words) -> None:
    copy = Path(shutil.copytree(checkpoint, tmp_path / "copy"))
    config = json.loads((copy / "config.json").read_text())
    config[field] = value
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=words):
        load_model(ModelConfig(model=str(copy), dtype="float32"))
