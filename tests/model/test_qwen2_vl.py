"""Qwen2-VL and Qwen2.5-VL (window attention in its tower) against transformers on tiny random checkpoints it
writes (float32): the processor's expansion (each
image's placeholder count from its own grid), the M-RoPE positions against transformers' `get_rope_index`, logits
of a flat batch of two images of different sizes and a text-only prompt within 1e-4 (also with prefill chunks that
split an image's placeholder run), and greedy generation through LLM identical (batched, chunked, and decode
steps continuing from the prompt's M-RoPE offset)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

from kestrel import LLM
from kestrel.config import ConfigError, ModelConfig
from kestrel.entrypoints.media import load_processor
from kestrel.loader import load_model
from kestrel.model.layers.rotary import RopeConfig, RotaryEmbedding
from kestrel.worker.input_batch import CachedRequestState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from multimodal_checkpoints import QWEN_IMAGE_PAD, random_image, write_qwen2_vl  # noqa: E402
from test_llava import BLOCKS_PER_SEQ, PagedBatch, hf_greedy_ids, llm_greedy_ids, request_state  # noqa: E402

REL_TOL = 1e-4
IMAGE = f"<|vision_start|>{QWEN_IMAGE_PAD}<|vision_end|>"
PROMPTS = [  # (text, (width, height) of each image)
    (f"<|im_start|>user\n{IMAGE}what is this?<|im_end|>\n<|im_start|>assistant\n", [(40, 34)]),
    ("<|im_start|>user\nno picture here at all<|im_end|>\n<|im_start|>assistant\n", []),
    (f"<|im_start|>user\n{IMAGE}and {IMAGE}compare<|im_end|>\n<|im_start|>assistant\n", [(24, 60), (52, 30)]),
]


def case(index: int) -> tuple[str, list]:
    text, sizes = PROMPTS[index]
    return text, [random_image(10 * index + k, width=w, height=h) for k, (w, h) in enumerate(sizes)]


@pytest.fixture(scope="module", params=["2", "2.5"])
def qwen_dir(tmp_path_factory, request) -> Path:
    return write_qwen2_vl(tmp_path_factory.mktemp(f"qwen{request.param}-vl"), seed=5, version=request.param)


@pytest.fixture(scope="module")
def hf(qwen_dir):
    architecture = json.loads((qwen_dir / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(str(qwen_dir), dtype=torch.float32).eval()
    return model, load_processor(str(qwen_dir))


@pytest.fixture(scope="module")
def llm(qwen_dir) -> LLM:
    return LLM(str(qwen_dir), dtype="float32", max_model_len=256)


def hf_inputs(processor, index: int) -> dict[str, torch.Tensor]:
    text, images = case(index)
    return processor(text=text, images=images or None, return_tensors="pt")


def kestrel_state(llm: LLM, index: int) -> CachedRequestState:
    return request_state(llm, str(index), *case(index))


class MRopeBatch(PagedBatch):
    """LLaVA's paged batch with each request's M-RoPE positions, as the runner gives them."""

    def step(self, counts: list[int]) -> list[torch.Tensor]:
        rows = []
        for state, count in zip(self.states, counts):
            prompt, _ = self.model.mrope_positions(state.token_ids, state.media)
            rows.append(prompt[:, state.num_computed_tokens: state.num_computed_tokens + count])
        positions = torch.cat(rows, dim=1)
        original = self.model.forward

        def forward(ids, _flat, metadata, inputs_embeds=None):
            return original(ids, positions, metadata, inputs_embeds=inputs_embeds)

        self.model.forward = forward
        try:
            return super().step(counts)
        finally:
            del self.model.forward


def test_expansion_and_positions_match_transformers(llm, hf) -> None:
    model_hf, processor = hf
    grids = set()
    for index in range(len(PROMPTS)):
        state = kestrel_state(llm, index)
        inputs = hf_inputs(processor, index)
        assert state.token_ids == inputs["input_ids"][0].tolist()
        for item, grid in zip(state.media, inputs.get("image_grid_thw", [])):
            assert item.num_embeds == int(grid.prod()) // 4
            grids.add(tuple(grid.tolist()))
        positions, offset = llm.runner.model.mrope_positions(state.token_ids, state.media)
        if state.media:
            ref, deltas = model_hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                        inputs["image_grid_thw"])
            assert torch.equal(positions, ref[:, 0]) and offset == int(deltas)
        else:
            assert torch.equal(positions, torch.arange(len(state.token_ids)).expand(3, -1)) and offset == 0
    assert len(grids) == 3  # three images, three grids: their placeholder counts differ


@pytest.mark.parametrize("chunk", [None, 7])
def test_logits_match_transformers_in_a_mixed_batch(llm, hf, qwen_dir, chunk) -> None:
    model_hf, processor = hf
    model = load_model(ModelConfig(model=str(qwen_dir), dtype="float32"))
    states = [kestrel_state(llm, i) for i in range(len(PROMPTS))]
    batch = MRopeBatch(model, states)
    lengths = [len(s.token_ids) for s in states]
    tables = torch.arange(1, len(states) * BLOCKS_PER_SEQ + 1, dtype=torch.int32).view(len(states), BLOCKS_PER_SEQ)
    pieces: list[list[torch.Tensor]] = [[] for _ in states]
    split = False
    while any(s.num_computed_tokens < n for s, n in zip(states, lengths)):
        counts = [min(chunk or n, n - s.num_computed_tokens) for s, n in zip(states, lengths)]
        for state, count in zip(states, counts):
            split |= any(start < state.num_computed_tokens + count < start + length
                         for item in state.media for start, length in item.ranges)
        live = [i for i, c in enumerate(counts) if c]
        batch.states, batch.block_tables = [states[i] for i in live], tables[live]
        for i, logits in zip(live, batch.step([counts[i] for i in live])):
            pieces[i].append(logits)
    assert split == (chunk is not None)
    assert batch.encoder.num_items_encoded == 3
    for index, parts in enumerate(pieces):
        with torch.no_grad():
            ref = model_hf(**hf_inputs(processor, index)).logits[0].float()
        rel = ((torch.cat(parts) - ref).abs().max() / ref.abs().max()).item()
        assert rel < REL_TOL, f"prompt {index}: relative error {rel:.2e}"


def hf_greedy(hf, index: int) -> list[int]:
    model, processor = hf
    return hf_greedy_ids(model, hf_inputs(processor, index))


def kestrel_greedy(llm: LLM, indices: list[int]) -> list[list[int]]:
    return llm_greedy_ids(llm, [case(i) for i in indices], "image")


def test_greedy_matches_transformers_batched_and_chunked(llm, hf, qwen_dir) -> None:
    expected = [hf_greedy(hf, i) for i in range(len(PROMPTS))]
    assert kestrel_greedy(llm, [0, 1, 2]) == expected
    chunked = LLM(str(qwen_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=7, max_num_seqs=4,
                  enable_prefix_caching=False)
    assert kestrel_greedy(chunked, [2, 0, 1]) == [expected[2], expected[0], expected[1]]
    assert chunked.runner.media_encoder.num_items_encoded == 3


def test_mrope_rotation_and_config_refusals() -> None:
    """Three equal position rows rotate as plain RoPE; rows that differ turn each section by its own row."""
    rope = RotaryEmbedding(16, 64, RopeConfig(params={"mrope_section": [1, 3, 4]}))
    plain = RotaryEmbedding(16, 64)
    q, k = torch.randn(5, 32), torch.randn(5, 16)
    flat = torch.tensor([0, 3, 9, 20, 63])
    for a, b in zip(rope(flat.expand(3, -1), q, k), plain(flat, q, k)):
        assert torch.equal(a, b)
    rows = torch.stack([flat, flat.flip(0), flat // 2])
    rotated, _ = rope(rows, q, k)
    for j, row in enumerate([0, 1, 1, 1, 2, 2, 2, 2]):
        cos, sin = plain.cos_cache[rows[row], j][:, None], plain.sin_cache[rows[row], j][:, None]
        x = q.view(5, 2, 16)
        expected = x[..., j] * cos - x[..., j + 8] * sin
        assert torch.allclose(rotated.view(5, 2, 16)[..., j], expected, atol=1e-6)
    with pytest.raises(ConfigError, match="mrope_section"):
        RotaryEmbedding(16, 64, RopeConfig(params={"mrope_section": [2, 3, 4]}))
    legacy = RopeConfig.from_hf({"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}})
    assert legacy.rope_type == "default" and legacy.params["mrope_section"] == [2, 3, 3]
