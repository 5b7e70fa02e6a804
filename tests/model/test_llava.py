"""LLaVA-1.5 against transformers on a tiny random checkpoint it writes (float32): the processor's expansion of the
image placeholders, logits of flat batches mixing text-only and image prompts (one and two images) within 1e-4,
the same with prefill chunks that split an image's placeholder run, and greedy generation through LLM identical
(also under 8-token chunks and with the prefix cache warm)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from kestrel import LLM, SamplingParams
from kestrel.config import ModelConfig
from kestrel.loader import load_model
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.sampling_params import SamplingParams as Params
from kestrel.worker.input_batch import CachedRequestState
from kestrel.worker.media_encoder import MediaEncoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from multimodal_checkpoints import IMAGE_TOKEN, TOKENS_PER_IMAGE, random_image, write_llava  # noqa: E402

REL_TOL = 1e-4
BLOCK_SIZE = 16
BLOCKS_PER_SEQ = 8
MAX_NEW = 8


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> Path:
    return write_llava(tmp_path_factory.mktemp("llava"), seed=3)


@pytest.fixture(scope="module")
def hf(llava_dir):
    model = transformers.LlavaForConditionalGeneration.from_pretrained(str(llava_dir), dtype=torch.float32).eval()
    return model, transformers.AutoProcessor.from_pretrained(str(llava_dir))


@pytest.fixture(scope="module")
def llm(llava_dir) -> LLM:
    return LLM(str(llava_dir), dtype="float32", max_model_len=256)


PROMPTS = [  # (text, number of images)
    (f"USER: {IMAGE_TOKEN}\nwhat is in the picture? ASSISTANT:", 1),
    ("USER: a prompt with no image at all ASSISTANT:", 0),
    (f"USER: {IMAGE_TOKEN}\n{IMAGE_TOKEN}\ncompare these two ASSISTANT:", 2),
]


def case(index: int) -> tuple[str, list]:
    text, count = PROMPTS[index]
    return text, [random_image(10 * index + k, width=40 + 7 * k) for k in range(count)]


def hf_inputs(processor, text: str, images: list) -> dict[str, torch.Tensor]:
    return processor(text=text, images=images or None, return_tensors="pt")


def hf_logits(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits[0].float()


class PagedBatch:
    """Runs prompts through the model as the runner does: the encoder step fills each scheduled placeholder
    position, the KV cache is paged and the prompt may be fed in chunks."""

    def __init__(self, model, states: list[CachedRequestState]) -> None:
        num_blocks = len(states) * BLOCKS_PER_SEQ + 1
        for layer in model.attention_layers():
            layer.bind_kv_cache(torch.zeros(2, num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_size))
        self.block_tables = torch.arange(1, num_blocks, dtype=torch.int32).view(len(states), BLOCKS_PER_SEQ)
        self.model = model
        self.states = states
        self.encoder = MediaEncoder(model, cache_rows=1024)

    def step(self, counts: list[int]) -> list[torch.Tensor]:
        input_ids, positions, slots, seq_lens = [], [], [], []
        for s, (state, count) in enumerate(zip(self.states, counts)):
            start, end = state.num_computed_tokens, state.num_computed_tokens + count
            input_ids += state.token_ids[start:end]
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
        with torch.no_grad():
            embeds = self.encoder.input_embeds(self.states, counts, ids)
            hidden = self.model(ids, torch.tensor(positions), metadata, inputs_embeds=embeds)
            logits = self.model.compute_logits(hidden)
        for state, count in zip(self.states, counts):
            state.num_computed_tokens += count
        return list(logits.split(counts))


def request_state(llm: LLM, request_id: str, text: str, items: list) -> CachedRequestState:
    """A request's runner state as LLM builds it: the prompt's placeholders expanded for its media items (shared
    by every multimodal model's tests)."""
    ids, media = llm.media.expand(llm.tokenizer.encode(text), items, "multi_modal_data")
    return CachedRequestState(request_id, ids, len(ids), Params(), [[]], 0, media=media)


def kestrel_state(llm: LLM, index: int) -> CachedRequestState:
    return request_state(llm, str(index), *case(index))


def test_placeholder_expansion_matches_the_processor(llm, hf) -> None:
    _, processor = hf
    for index in range(len(PROMPTS)):
        text, images = case(index)
        state = kestrel_state(llm, index)
        assert state.token_ids == hf_inputs(processor, text, images)["input_ids"][0].tolist()
        assert [item.num_embeds for item in state.media] == [TOKENS_PER_IMAGE] * len(images)
        for item in state.media:
            assert all(state.token_ids[p] == llm.media.image_token_id
                       for start, length in item.ranges for p in range(start, start + length))


@pytest.mark.parametrize("chunk", [None, 8, 5])
def test_logits_match_transformers_in_a_mixed_batch(llm, hf, llava_dir, chunk) -> None:
    """Text-only, one-image and two-image prompts in one flat batch; with `chunk`, every prompt is fed that many
    tokens a step, so chunks end inside the images' 16-token placeholder runs (each image encoded once)."""
    model_hf, processor = hf
    model = load_model(ModelConfig(model=str(llava_dir), dtype="float32"))
    states = [kestrel_state(llm, i) for i in range(len(PROMPTS))]
    batch = PagedBatch(model, states)
    lengths = [len(s.token_ids) for s in states]
    pieces: list[list[torch.Tensor]] = [[] for _ in states]
    while any(s.num_computed_tokens < n for s, n in zip(states, lengths)):
        counts = [min(chunk or n, n - s.num_computed_tokens) for s, n in zip(states, lengths)]
        live = [i for i, c in enumerate(counts) if c]
        batch.states = [states[i] for i in live]
        batch.block_tables = torch.arange(1, len(states) * BLOCKS_PER_SEQ + 1, dtype=torch.int32).view(
            len(states), BLOCKS_PER_SEQ)[live]
        for i, logits in zip(live, batch.step([counts[i] for i in live])):
            pieces[i].append(logits)
    assert batch.encoder.num_items_encoded == 3  # each image once, whatever the chunking
    for index, parts in enumerate(pieces):
        text, images = case(index)
        ref = hf_logits(model_hf, hf_inputs(processor, text, images))
        ours = torch.cat(parts)
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < REL_TOL, f"prompt {index}: relative error {rel:.2e}"


def hf_greedy_ids(model, inputs: dict[str, torch.Tensor]) -> list[int]:
    """transformers' greedy continuation of one processed prompt: MAX_NEW tokens, EOS ignored."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def llm_greedy_ids(llm: LLM, prompts: list[tuple[str, list]], modality: str) -> list[list[int]]:
    """LLM.generate's greedy continuations (MAX_NEW tokens, EOS ignored) of (text, media items) prompts, the items
    as multi_modal_data[modality]."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    inputs = [{"prompt": text, "multi_modal_data": {modality: items}} if items else text for text, items in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]


def hf_greedy(hf, index: int) -> list[int]:
    model, processor = hf
    return hf_greedy_ids(model, hf_inputs(processor, *case(index)))


def kestrel_greedy(llm: LLM, indices: list[int]) -> list[list[int]]:
    return llm_greedy_ids(llm, [case(i) for i in indices], "image")


def test_greedy_matches_transformers_batched_chunked_and_cached(llm, hf, llava_dir) -> None:
    expected = [hf_greedy(hf, i) for i in range(len(PROMPTS))]
    assert kestrel_greedy(llm, [0, 1, 2]) == expected
    # The prefix cache is warm now: the same prompts again reuse their blocks, images included.
    cached_before = llm.engine.scheduler.kv.prefix_hits
    assert kestrel_greedy(llm, [2, 0]) == [expected[2], expected[0]]
    assert llm.engine.scheduler.kv.prefix_hits > cached_before
    chunked = LLM(str(llava_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=8, max_num_seqs=4,
                  enable_prefix_caching=False)
    assert kestrel_greedy(chunked, [0, 1, 2]) == expected
    assert chunked.runner.media_encoder.num_items_encoded == 3


def test_encoder_cache_serves_a_repeated_image_without_running_the_encoder(llava_dir) -> None:
    llm = LLM(str(llava_dir), dtype="float32", max_model_len=256, enable_prefix_caching=False)
    encoder = llm.runner.media_encoder
    first = kestrel_greedy(llm, [0])
    calls, items = encoder.num_encoder_calls, encoder.num_items_encoded
    assert (calls, items) == (1, 1)
    assert kestrel_greedy(llm, [0]) == first  # same image: its rows come from the cache
    assert (encoder.num_encoder_calls, encoder.num_items_encoded) == (1, 1)
    kestrel_greedy(llm, [2])  # two new images: one encoder pass for both
    assert (encoder.num_encoder_calls, encoder.num_items_encoded) == (2, 3)


def test_prefix_cache_never_shares_blocks_across_different_images(llm) -> None:
    """Same text, same placeholder ids, different pixels: no prefix hit on the image's blocks, and each answer is
    the one its own image gives alone."""
    text, _ = case(0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = [{"prompt": text, "multi_modal_data": {"image": random_image(seed)}} for seed in (101, 102)]
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    image_start = llm.tokenizer.encode(text).index(llm.media.image_token_id)
    again = llm.generate([prompts[1]], params, use_tqdm=False)[0]
    assert alone[1].num_cached_tokens <= image_start  # the first image's blocks were not reused
    assert again.num_cached_tokens > image_start  # its own image's blocks were
    assert again.outputs[0].token_ids == alone[1].outputs[0].token_ids
    fresh = LLM(llm.config.model.model, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in fresh.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in alone]


def test_a_malformed_media_item_is_refused_alone(llm) -> None:
    """Bad media items are refused when the request is added, naming the input; a request beside them runs."""
    from kestrel.request import InvalidRequestError, MediaItem

    engine = llm.engine
    good = kestrel_state(llm, 0)
    bad_items = [
        (MediaItem("image", "h", ((3, 400),), good.media[0].data), "past the prompt"),
        (MediaItem("image", "h", ((5, 0),), good.media[0].data), "length >= 1"),
        (MediaItem("image", "", ((5, 4),), good.media[0].data), "content hash"),
    ]
    for item, words in bad_items:
        with pytest.raises(InvalidRequestError, match=words) as error:
            engine.add_request(f"bad-{words}", good.token_ids, Params(max_tokens=2), media=(item,))
        assert error.value.param == "multi_modal_data[0]"
    with pytest.raises(InvalidRequestError, match="placeholder"):
        llm.generate({"prompt": "no placeholder here", "multi_modal_data": {"image": [random_image(1)]}},
                     use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="PIL image"):
        llm.generate({"prompt": f"{IMAGE_TOKEN}", "multi_modal_data": {"image": ["not an image"]}}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="not supported"):
        llm.generate({"prompt": "x", "multi_modal_data": {"video": [b"x"]}}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="does not take audio"):
        llm.generate({"prompt": "x", "multi_modal_data": {"audio": [(np.zeros(1600, np.float32), 16000)]}},
                     use_tqdm=False)
    assert kestrel_greedy(llm, [0]) == [hf_greedy_cached(llm, 0)]


_GREEDY: dict[int, list[int]] = {}


def hf_greedy_cached(llm: LLM, index: int) -> list[int]:
    if index not in _GREEDY:
        _GREEDY[index] = kestrel_greedy(LLM(llm.config.model.model, dtype="float32", max_model_len=256), [index])[0]
    return _GREEDY[index]


def test_limit_mm_per_prompt_and_text_only_models(llava_dir, tmp_path) -> None:
    from kestrel.config import ConfigError
    from kestrel.loader.model_init import write_tiny_checkpoint
    from kestrel.request import InvalidRequestError

    limited = LLM(str(llava_dir), dtype="float32", max_model_len=256, limit_mm_per_prompt={"image": 1})
    text, images = case(2)
    with pytest.raises(InvalidRequestError, match="at most 1") as error:
        limited.generate({"prompt": text, "multi_modal_data": {"image": images}}, use_tqdm=False)
    assert error.value.param == "multi_modal_data"
    with pytest.raises(ConfigError, match="limit_mm_per_prompt.audio"):
        LLM(str(llava_dir), dtype="float32", max_model_len=256, limit_mm_per_prompt={"audio": 1})
    with pytest.raises(ConfigError, match="mm_processor_kwargs.no_such_setting"):
        LLM(str(llava_dir), dtype="float32", max_model_len=256, mm_processor_kwargs={"no_such_setting": 1})
    write_tiny_checkpoint(tmp_path / "text", arch="llama", seed=1)
    with pytest.raises(ConfigError, match="takes text only"):
        LLM(str(tmp_path / "text"), dtype="float32", max_model_len=64, limit_mm_per_prompt={"image": 2})
    text_llm = LLM(str(tmp_path / "text"), dtype="float32", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="text only") as error:
        text_llm.generate({"prompt": "hi", "multi_modal_data": {"image": random_image(0)}}, use_tqdm=False)
    assert error.value.param == "multi_modal_data"
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(InvalidRequestError, match="text only") as error:
        text_llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}], use_tqdm=False)
    assert error.value.param == "messages[0].content[1]"


def test_chat_with_image_url_parts_matches_generate(llm) -> None:
    import base64
    import io

    image = random_image(7)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "describe it"}]}]
    (chat,) = llm.chat(messages, params, use_tqdm=False)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "describe it"}]}], tokenize=False, add_generation_prompt=True)
    assert text.startswith(f"USER: {IMAGE_TOKEN}\ndescribe it")
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    (plain,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, params,
                            use_tqdm=False)
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


def test_async_llm_takes_the_prompts_images(llava_dir, hf) -> None:
    """AsyncLLM.generate expands a prompt's multi_modal_data as LLM.generate does: greedy as transformers."""
    import asyncio

    from kestrel import AsyncLLM

    async def run() -> list[int]:
        llm = AsyncLLM(str(llava_dir), dtype="float32", max_model_len=256)
        try:
            text, images = case(0)
            params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
            outputs = [out async for out in llm.generate({"prompt": text, "multi_modal_data": {"image": images}},
                                                         params, request_id="image")]
            return outputs[-1].outputs[0].token_ids
        finally:
            llm.shutdown()

    assert asyncio.run(run()) == hf_greedy(hf, 0)
