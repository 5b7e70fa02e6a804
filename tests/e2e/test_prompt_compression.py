"""Prompt compression through LLM: kestrel-tiny serves and compresses (CPU). Determinism and the prefix cache, the
rate reached, what stays verbatim, the refusals."""

import inspect
import json
import textwrap

import pytest

from kestrel import LLM, SamplingParams
from kestrel.config import ConfigError, EngineConfig
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import KEEP_MARKERS
from kestrel.tiny import BUNDLED_MODEL_DIR

DOC = textwrap.dedent(json.__doc__)  # prose and examples, about 1,000 served tokens
SOURCE = inspect.getsource(json.dumps)[:1500]


@pytest.fixture(scope="module")
def llm():
    return LLM(prompt_compressor="kestrel-tiny", device="cpu", dtype="float32", max_model_len=512,
               enable_prefix_caching=True)


def greedy(**compression):
    return SamplingParams(max_tokens=4, temperature=0.0, prompt_compression=compression or None)


def decoded(llm, output):
    return llm.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)


def test_same_prompt_same_compression_and_a_prefix_cache_hit(llm):
    first = llm.generate([SOURCE], greedy(rate=0.5), use_tqdm=False)[0]
    second = llm.generate([SOURCE], greedy(rate=0.5), use_tqdm=False)[0]
    assert first.prompt_token_ids == second.prompt_token_ids
    assert first.original_num_prompt_tokens > len(first.prompt_token_ids)
    block = llm.config.cache.block_size
    assert second.num_cached_tokens >= (len(second.prompt_token_ids) - 1) // block * block > 0


@pytest.mark.parametrize("rate", [0.8, 0.5, 0.33])
def test_the_rate_is_reached_in_served_tokens(llm, rate):
    (out,) = llm.generate([SOURCE], greedy(rate=rate), use_tqdm=False)
    achieved = len(out.prompt_token_ids) / out.original_num_prompt_tokens
    assert abs(achieved - rate) <= 0.08, achieved


def test_rate_one_keeps_the_prompt(llm):
    (out,) = llm.generate([SOURCE], greedy(rate=1.0), use_tqdm=False)
    assert out.prompt_token_ids == llm.tokenizer.encode(SOURCE)
    assert out.original_num_prompt_tokens == len(out.prompt_token_ids)


def test_chat_keeps_template_system_and_last_user_turn(llm):
    system = "You answer questions about the json module."
    question = "What does json.dumps return when indent is given?"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": SOURCE},
                {"role": "assistant", "content": "It is the source of json.dumps."},
                {"role": "user", "content": question}]
    (out,) = llm.chat(messages, greedy(rate=0.4), use_tqdm=False)
    (plain,) = llm.chat(messages, greedy(), use_tqdm=False)
    text, full = decoded(llm, out), decoded(llm, plain)
    assert system in text and question in text
    assert SOURCE not in text and len(out.prompt_token_ids) < 0.75 * len(plain.prompt_token_ids)
    assert out.original_num_prompt_tokens == len(plain.prompt_token_ids)
    for special in llm.tokenizer.all_special_tokens:
        assert text.count(special) == full.count(special), special
    for header in ("<|start_header_id|>system<|end_header_id|>", "<|start_header_id|>user<|end_header_id|>",
                   "<|start_header_id|>assistant<|end_header_id|>"):
        assert text.count(header) == full.count(header) > 0


def test_chat_system_and_last_turn_compress_when_asked(llm):
    messages = [{"role": "system", "content": DOC[:1200]}, {"role": "user", "content": SOURCE}]
    (out,) = llm.chat(messages, greedy(rate=0.4, keep_system=False, keep_last_user_turn=False), use_tqdm=False)
    text = decoded(llm, out)
    assert DOC[:1200] not in text and SOURCE not in text


def test_code_blocks_stay_when_asked(llm):
    code = "```python\n" + SOURCE[:400] + "\n```"
    prompt = DOC[:1500] + "\n" + code + "\nThat is all."
    (kept,) = llm.generate([prompt], greedy(rate=0.4, keep_code_blocks=True), use_tqdm=False)
    (cut,) = llm.generate([prompt], greedy(rate=0.4), use_tqdm=False)
    assert code in decoded(llm, kept)
    assert code not in decoded(llm, cut)


def test_marked_spans_and_keep_spans_stay_and_markers_go(llm):
    opening, closing = KEEP_MARKERS
    marked = DOC[300:420]
    prompt = DOC[:300] + opening + marked + closing + DOC[420:1500]
    (out,) = llm.generate([prompt], greedy(rate=0.4), use_tqdm=False)
    text = decoded(llm, out)
    assert marked in text and opening not in text and closing not in text
    start = DOC.index("Encoding basic")
    (out,) = llm.generate([DOC[:1500]], greedy(rate=0.4, keep_spans=[[start, start + 80]]), use_tqdm=False)
    assert DOC[start: start + 80] in decoded(llm, out)


def test_special_tokens_in_a_text_prompt_stay(llm):
    prompt = DOC[:700] + "<|end_of_text|>" + DOC[700:1400]
    (out,) = llm.generate([prompt], greedy(rate=0.3), use_tqdm=False)
    eot = llm.tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    assert out.prompt_token_ids.count(eot) == 1


@pytest.mark.parametrize("prompt, compression, param", [
    ({"prompt_token_ids": [5, 6, 7]}, {"rate": 0.5}, "prompt_compression"),
    (DOC, {"rate": 0.5, "keep_system": True}, "prompt_compression.keep_system"),
    (DOC, {"rate": 0.5, "keep_last_user_turn": False}, "prompt_compression.keep_last_user_turn"),
    (DOC[:50], {"rate": 0.5, "keep_spans": [[0, 51]]}, "prompt_compression.keep_spans"),
    (KEEP_MARKERS[0] + DOC[:50], {"rate": 0.5}, "prompt_compression"),
])
def test_refusals_name_the_field(llm, prompt, compression, param):
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([prompt], greedy(**compression), use_tqdm=False)
    assert error.value.param == param


def test_keep_spans_in_a_chat_are_refused(llm):
    with pytest.raises(InvalidRequestError) as error:
        llm.chat([{"role": "user", "content": DOC}], greedy(rate=0.5, keep_spans=[[0, 4]]), use_tqdm=False)
    assert error.value.param == "prompt_compression.keep_spans"


def test_without_a_compressor_compression_is_refused_naming_the_argument():
    plain = LLM(device="cpu", dtype="float32", max_model_len=128, kv_cache_blocks=16)
    with pytest.raises(InvalidRequestError, match="prompt_compressor") as error:
        plain.generate(["hello"], greedy(rate=0.5), use_tqdm=False)
    assert error.value.param == "prompt_compression"


@pytest.mark.parametrize("compressor, words", [
    ("/no/such/dir", "config.json"),
    (str(BUNDLED_MODEL_DIR.parent / "kestrel-tiny-eagle"), "causal LM"),
    ("", "model directory"),
])
def test_a_bad_compressor_is_a_config_error(compressor, words):
    with pytest.raises(ConfigError, match="prompt_compressor") as error:
        EngineConfig.from_kwargs(str(BUNDLED_MODEL_DIR), prompt_compressor=compressor)
    assert words in str(error.value)


def test_scorer_matches_transformers_window_by_window(llm):
    """The compressor's one-forward scorer against transformers' log-softmax of each window on its own."""
    import torch
    import transformers

    from kestrel.worker.prompt_scoring import token_surprisal

    compressor = llm.prompt_compressor
    ids = compressor.tokenizer.encode(DOC, add_special_tokens=False)
    windows = [ids[:300], ids[100:111], ids[250:500], ids[7:8] + ids[40:42]]
    score_from = [1, 5, 125, 2]
    got = token_surprisal(compressor.runner, windows, score_from)
    hf = transformers.AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, dtype=torch.float32).eval()
    for window, first, values in zip(windows, score_from, got):
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([window])).logits[0].double(), dim=-1)
        expected = [-logprobs[p - 1, window[p]].item() for p in range(first, len(window))]
        assert len(values) == len(expected)
        torch.testing.assert_close(torch.tensor(values, dtype=torch.float64),
                                   torch.tensor(expected, dtype=torch.float64), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="score_from"):
        token_surprisal(compressor.runner, [ids[:10]], [0])
    with pytest.raises(ValueError, match="cache blocks"):
        token_surprisal(compressor.runner, [ids[:400]] * 100, [1] * 100)
