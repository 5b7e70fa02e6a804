"""Gemma 3 with images against transformers on a tiny random checkpoint it writes (float32; SigLIP tower, the
projector's 2x2 average pooling, a sliding-window layer of 8 and a global layer): the processor's expansion, logits of
one flat batch mixing one-image, text-only and two-image prompts within 1e-4 (transformers' prefill mask lets an
image's 16 placeholders attend to one another both ways, the window still cutting in), also in prefill chunks that
end beside images, never inside them; greedy generation identical; prefix caching never sharing an image's KV; the
scheduler keeping every image within one step."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import transformers

from kestrel import LLM, SamplingParams
from kestrel.config import ModelConfig
from kestrel.loader import load_model
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.request import InvalidRequestError, end_outside_runs
from kestrel.worker.media_attention import with_causal_ends
from kestrel.worker.step_inputs import ScheduledStep

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from multimodal_checkpoints import (  # noqa: E402
    GEMMA3_BOI,
    GEMMA3_TOKENS_PER_IMAGE,
    GEMMA3_WINDOW,
    random_image,
    write_gemma3,
)
from test_llava import BLOCK_SIZE, MAX_NEW, PagedBatch, hf_greedy_ids, llm_greedy_ids, request_state  # noqa: E402

REL_TOL = 1e-4
PROMPTS = [  # (text, number of images)
    (f"<start_of_turn>user\n{GEMMA3_BOI}what is in the picture?<end_of_turn>\n<start_of_turn>model\n", 1),
    ("<start_of_turn>user\na prompt with no image at all<end_of_turn>\n<start_of_turn>model\n", 0),
    (f"<start_of_turn>user\n{GEMMA3_BOI} and {GEMMA3_BOI} compare these two<end_of_turn>\n<start_of_turn>model\n", 2),
]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> Path:
    return write_gemma3(tmp_path_factory.mktemp("gemma3"), seed=5)


@pytest.fixture(scope="module")
def hf(gemma3_dir):
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(gemma3_dir), dtype=torch.float32).eval()
    return model, transformers.AutoProcessor.from_pretrained(str(gemma3_dir))


@pytest.fixture(scope="module")
def llm(gemma3_dir) -> LLM:
    return LLM(str(gemma3_dir), dtype="float32", max_model_len=256)


def case(index: int) -> tuple[str, list]:
    text, count = PROMPTS[index]
    return text, [random_image(30 + 10 * index + k, width=40 + 9 * k) for k in range(count)]


def hf_inputs(processor, text: str, images: list) -> dict[str, torch.Tensor]:
    return processor(text=text, images=images or None, return_tensors="pt")


def hf_logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits[0].float()


def state(llm: LLM, index: int):
    """The request's runner state, its items marked as the engine marks a bidirectional model's."""
    s = request_state(llm, str(index), *case(index))
    s.media = tuple(dataclasses.replace(item, bidirectional=True) for item in s.media)
    return s


class ImageBatch(PagedBatch):
    """PagedBatch whose steps carry the runner's causal ends."""

    def step(self, counts: list[int]) -> list[torch.Tensor]:
        input_ids, positions, slots, seq_lens = [], [], [], []
        for s, (st, count) in enumerate(zip(self.states, counts)):
            start, end = st.num_computed_tokens, st.num_computed_tokens + count
            input_ids += st.token_ids[start:end]
            positions += range(start, end)
            slots += [int(self.block_tables[s, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                      for p in range(start, end)]
            seq_lens.append(end)
        ids = torch.tensor(input_ids)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=self.block_tables,
            max_query_len=max(counts), max_seq_len=max(seq_lens))
        inputs = _Inputs(ids, torch.tensor(positions), metadata)
        metadata = with_causal_ends(ScheduledStep([st.req_id for st in self.states], self.states, counts,
                                                  inputs)).inputs.attn_metadata
        with torch.no_grad():
            embeds = self.encoder.input_embeds(self.states, counts, ids)
            hidden = self.model(ids, inputs.positions, metadata, inputs_embeds=embeds)
            logits = self.model.compute_logits(hidden)
        for st, count in zip(self.states, counts):
            st.num_computed_tokens += count
        return list(logits.split(counts))


@dataclasses.dataclass
class _Inputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata


def test_transformers_attends_both_ways_within_an_image(hf) -> None:
    """The oracle's premise: without the processor's token types (a causal mask) transformers' logits differ."""
    model, processor = hf
    inputs = hf_inputs(processor, *case(0))
    causal = {key: value for key, value in inputs.items() if key != "token_type_ids"}
    assert (hf_logits(model, inputs) - hf_logits(model, causal)).abs().max() > 1e-3


def test_placeholder_expansion_matches_the_processor(llm, hf) -> None:
    _, processor = hf
    soft = processor.tokenizer.image_token_id
    for index in range(len(PROMPTS)):
        text, images = case(index)
        st = state(llm, index)
        expected = hf_inputs(processor, text, images)
        assert st.token_ids == expected["input_ids"][0].tolist()
        assert [item.num_embeds for item in st.media] == [GEMMA3_TOKENS_PER_IMAGE] * len(images)
        marked = [p for p, t in enumerate(expected["token_type_ids"][0].tolist()) if t == 1]
        assert [p for item in st.media for s, n in item.ranges for p in range(s, s + n)] == marked
        assert all(st.token_ids[p] == soft for p in marked)


@pytest.mark.parametrize("budget", [None, 20])
def test_logits_match_transformers_in_a_mixed_batch(llm, hf, gemma3_dir, budget) -> None:
    """One-image, text-only and two-image prompts in one flat batch; with `budget`, each prompt is fed at most that
    many tokens a step, cut where the scheduler cuts it: before an image's 16-token run, never inside it."""
    model_hf, processor = hf
    model = load_model(ModelConfig(model=str(gemma3_dir), dtype="float32"))
    states = [state(llm, i) for i in range(len(PROMPTS))]
    batch = ImageBatch(model, states)
    lengths = [len(s.token_ids) for s in states]
    pieces: list[list[torch.Tensor]] = [[] for _ in states]
    steps = 0
    while any(s.num_computed_tokens < n for s, n in zip(states, lengths)):
        counts = []
        for s, n in zip(states, lengths):
            start = s.num_computed_tokens
            counts.append(end_outside_runs(s.media, start, min(n, start + (budget or n))) - start)
        live = [i for i, c in enumerate(counts) if c]
        batch.states = [states[i] for i in live]
        batch.block_tables = torch.arange(1, len(states) * 8 + 1, dtype=torch.int32).view(len(states), 8)[live]
        for i, logits in zip(live, batch.step([counts[i] for i in live])):
            pieces[i].append(logits)
        steps += 1
    assert steps > 3 if budget else steps == 1
    for index, parts in enumerate(pieces):
        ref = hf_logits(model_hf, hf_inputs(processor, *case(index)))
        ours = torch.cat(parts)
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < REL_TOL, f"prompt {index}: relative error {rel:.2e}"


def test_a_step_cutting_an_image_is_refused(llm, gemma3_dir) -> None:
    model = load_model(ModelConfig(model=str(gemma3_dir), dtype="float32"))
    st = state(llm, 0)
    start = st.media[0].start
    with pytest.raises(RuntimeError, match="cuts the image run"):
        ImageBatch(model, [st]).step([start + 5])
    assert end_outside_runs(st.media, 0, start + 5) == start
    assert end_outside_runs(st.media, start, start + 5) == start  # nothing fits: the request waits for room


def kestrel_greedy(llm: LLM, indices: list[int]) -> list[list[int]]:
    return llm_greedy_ids(llm, [case(i) for i in indices], "image")


def test_greedy_matches_transformers_batched_chunked_and_cached(llm, hf, gemma3_dir) -> None:
    model, processor = hf
    expected = [hf_greedy_ids(model, hf_inputs(processor, *case(i))) for i in range(len(PROMPTS))]
    assert kestrel_greedy(llm, [0, 1, 2]) == expected
    cached_before = llm.engine.scheduler.kv.prefix_hits
    assert kestrel_greedy(llm, [2, 0]) == [expected[2], expected[0]]
    assert llm.engine.scheduler.kv.prefix_hits > cached_before
    # a 20-token budget: every prompt in several steps, each image within one
    chunked = LLM(str(gemma3_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=20, max_num_seqs=4,
                  enable_prefix_caching=False)
    assert kestrel_greedy(chunked, [0, 1, 2]) == expected
    stats = chunked.engine.scheduler.stats
    assert stats.num_steps >= -(-stats.num_prompt_tokens // 20) + MAX_NEW - 1  # the prompts took several steps


def test_prefix_cache_never_shares_an_image_across_requests(llm) -> None:
    """Same text, same placeholder ids, different pixels: no prefix hit on the image's blocks, and each answer is
    the one its own image gives alone."""
    text, _ = case(0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = [{"prompt": text, "multi_modal_data": {"image": random_image(seed)}} for seed in (201, 202)]
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    image_start = llm.tokenizer.encode(text).index(llm.media.image_token_id)
    again = llm.generate([prompts[1]], params, use_tqdm=False)[0]
    assert alone[1].num_cached_tokens <= image_start
    assert again.num_cached_tokens > image_start
    assert again.outputs[0].token_ids == alone[1].outputs[0].token_ids
    fresh = LLM(llm.config.model.model, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in fresh.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in alone]


def test_a_budget_smaller_than_an_image_is_refused_naming_it(gemma3_dir) -> None:
    small = LLM(str(gemma3_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=GEMMA3_WINDOW,
                max_num_seqs=2)
    text, images = case(0)
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens=8") as error:
        small.generate({"prompt": text, "multi_modal_data": {"image": images}}, use_tqdm=False)
    assert error.value.param == "multi_modal_data[0]"
    assert small.generate(case(1)[0], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_pan_and_scan_crops_match_transformers(hf, gemma3_dir) -> None:
    """With pan-and-scan on, a wide image brings its crops: each crop its own run of soft tokens after the
    original's (each attending to itself both ways), all encoded with the image; greedy identical."""
    model, processor = hf
    settings = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8, "pan_and_scan_max_num_crops": 3,
                "pan_and_scan_min_ratio_to_activate": 1.2}
    text, image = PROMPTS[0][0], random_image(4, width=120, height=30)
    inputs = processor(text=text, images=[image], return_tensors="pt", **settings)
    assert inputs["pixel_values"].shape[0] > 1
    expected = hf_greedy_ids(model, {key: value for key, value in inputs.items() if key != "num_crops"})
    llm = LLM(str(gemma3_dir), dtype="float32", max_model_len=512, mm_processor_kwargs=settings)
    (out,) = llm.generate({"prompt": text, "multi_modal_data": {"image": image}},
                          SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == expected
