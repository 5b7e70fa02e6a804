"""Structured outputs on kestrel-tiny: every constrained output is in the grammar's language (JSON validated with
jsonschema, regexes with `re`, choices by membership), across temperatures and seeds, n > 1, chunked prefill,
preemption and async scheduling; grammar masking and its logprobs against a float64 reference."""

import dataclasses
import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from kestrel import SamplingParams
from kestrel.ops import apply_token_bitmask
from kestrel.request import InvalidRequestError
from kestrel.sample.sampler import Sampler, SamplingMetadata, to_logprob_dicts
from kestrel.sampling_params import SamplingParamsError, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "language": {"enum": ["python", "c", "rust"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "language", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    from kestrel import LLM

    return LLM(max_model_len=256)


def constrained(seed: int, temperature: float, max_tokens: int = 96, **spec) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


def test_json_schema_outputs_validate_across_temperatures_and_seeds(llm):
    params = [constrained(seed, temperature, json=PERSON, disable_any_whitespace=True)
              for seed in range(3) for temperature in (0.0, 0.8, 1.5)]
    outputs = llm.generate(["A person, as JSON:\n"] * len(params), params, use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)


def test_regex_choice_grammar_and_json_object(llm):
    date = r"(19|20)\d\d-(0[1-9]|1[0-2])-[0-2]\d"
    colours = ["red", "green", "light blue"]
    for seed in range(4):
        out = llm.generate("Date: ", constrained(seed, 1.0, regex=date), use_tqdm=False)[0].outputs[0]
        assert re.fullmatch(date, out.text) and out.finish_reason == "stop", out.text
        out = llm.generate("Colour: ", constrained(seed, 1.0, choice=colours), use_tqdm=False)[0].outputs[0]
        assert out.text in colours and out.finish_reason == "stop"
        grammar = 'root ::= "def " name "():"\nname ::= [a-z] [a-z_]*'
        out = llm.generate("", constrained(seed, 1.0, max_tokens=24, grammar=grammar), use_tqdm=False)[0]
        text = out.outputs[0].text
        assert re.fullmatch(r"def [a-z][a-z_]*\(\):", text) or (
            out.outputs[0].finish_reason == "length" and re.fullmatch(r"def [a-z][a-z_]*", text)), text
    out = llm.generate("{", constrained(0, 0.0, max_tokens=200, json_object=True), use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # an object still open at max_tokens: a prefix of one
        assert out.text.lstrip().startswith("{")


def test_n_chunked_prefill_preemption_and_async_scheduling_keep_outputs_valid():
    from kestrel import LLM

    # Tiny KV cache and token budget: prompts are chunked and requests preempted while constrained.
    llm = LLM(max_model_len=128, kv_cache_blocks=10, max_num_batched_tokens=16, max_num_seqs=4,
              async_scheduling=True, enable_prefix_caching=False)
    prompt = "# a record of a person, written as one JSON object on one line\n" * 2
    params = constrained(7, 1.0, max_tokens=80, json=PERSON, disable_any_whitespace=True).replace(n=3)
    outputs = llm.generate([prompt] * 3, params, use_tqdm=False)
    assert llm.stats.num_preemptions > 0
    for out in outputs:
        assert len(out.outputs) == 3
        for completion in out.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), PERSON)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.structured._matchers


def test_max_tokens_inside_an_object_finishes_with_length(llm):
    out = llm.generate("x", constrained(0, 0.0, max_tokens=3, json=PERSON), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith("{")


def test_grammar_errors_name_the_field(llm):
    with pytest.raises(InvalidRequestError) as bad_regex:
        llm.generate("x", constrained(0, 0.0, regex="(unclosed"), use_tqdm=False)
    assert bad_regex.value.param == "structured_outputs.regex"
    with pytest.raises(InvalidRequestError) as bad_grammar:
        llm.generate("x", constrained(0, 0.0, grammar="root ::= undefined_rule"), use_tqdm=False)
    assert bad_grammar.value.param == "structured_outputs.grammar"
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    assert not llm.engine.has_unfinished_requests()


def test_constrained_logprobs_are_a_float64_masked_log_softmax():
    vocab, rows = 70, 4
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g) * 3
    allowed = torch.rand(rows, vocab, generator=g) < 0.3
    allowed[:, 0] = True  # every row allows something
    words = -(-vocab // 32)
    bits = np.zeros((2, words * 32), dtype=np.int64)
    bits[:, :vocab] = allowed[[1, 3]].numpy()
    packed = (bits.reshape(2, words, 32) << np.arange(32)).sum(axis=2).astype(np.uint32).view(np.int32)
    masked = apply_token_bitmask(logits.clone(), torch.from_numpy(packed), torch.tensor([1, 3]))
    params = [SamplingParams(temperature=1.0, seed=5, logprobs=5), SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=0.7, top_p=0.9, seed=6, logprobs=5),
              SamplingParams(temperature=0.0, logprobs=5)]
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    meta = SamplingMetadata.build(params, [[]] * rows, [[]] * rows, gens, frozenset(), vocab, "cpu")
    out = Sampler()(masked, meta)
    entries = to_logprob_dicts(out, [p.logprobs for p in params])
    x = logits.double().numpy()
    for row in range(rows):
        keep = allowed[row].numpy() if row in (1, 3) else np.ones(vocab, dtype=bool)
        ref = np.where(keep, x[row], -np.inf)
        ref = ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())
        sampled = out.sampled_token_ids[row].item()
        assert keep[sampled]
        for token, lp in entries[row].items():
            assert keep[token] and lp.logprob == pytest.approx(ref[token], abs=1e-5)
        if row == 3:  # greedy over the allowed tokens
            assert sampled == int(np.argmax(ref))


def test_settings_that_could_empty_the_grammar_mask_are_refused():
    for name, value in (("min_tokens", 3), ("allowed_token_ids", [5]), ("bad_words", ["x"])):
        with pytest.raises(SamplingParamsError) as refused:
            SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), **{name: value})
        assert refused.value.param == name


def test_a_stop_string_ending_a_constrained_request_releases_its_matcher(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=['"'],
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    out = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == '"'
    assert not llm.engine.structured._matchers


def test_async_scheduling_keeps_constrained_steps_async(monkeypatch):
    """Step N+1's forward is launched before step N's tokens reach the grammar; no step falls back to sync."""
    from kestrel import LLM

    llm = LLM(max_model_len=256, async_scheduling=True)

    def no_sync_step():
        raise AssertionError("a constrained batch stepped synchronously")

    monkeypatch.setattr(llm.engine, "_step_sync", no_sync_step)
    params = [constrained(seed, 1.0, json=PERSON, disable_any_whitespace=True) for seed in range(4)]
    outputs = llm.generate(["A person, as JSON:\n"] * 4, params, use_tqdm=False)
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    assert not llm.engine.structured._matchers


def test_reused_bitmask_buffers_hold_each_steps_own_masks(llm):
    """Masks are filled into two reused buffers that grow with the batch: each step's rows must equal a fresh
    xgrammar fill of the same matchers, whatever the earlier steps left in the buffer."""
    import xgrammar as xgr

    backend = llm.engine.structured
    specs = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(regex=r"[0-9]{3}"),
             StructuredOutputsParams(choice=["yes", "no"])]
    for batch in (1, 3, 2, 5, 1):
        ids = [f"buffer-{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            backend.add(rid, specs[i % len(specs)])
        got = backend.bitmask(ids)
        for row, rid in enumerate(ids):
            fresh = xgr.allocate_token_bitmask(1, backend.vocab_size)
            backend._matchers[rid].fill_next_token_bitmask(fresh, 0)
            assert torch.equal(got.bitmask[row], fresh[0]), (batch, row)
        for rid in ids:
            backend.remove(rid)


@pytest.mark.parametrize("engine_args", [{}, {"async_scheduling": True},
                                         {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                                 "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
                                         {"grammar_workers": 1}],
                         ids=["sync", "async", "ngram", "grammar-worker"])
def test_a_grammar_after_thinking_shapes_only_the_answer(engine_args):
    """after_thinking with the real sampler: the answer starts inside a 'thinking' that ends at the newline token
    (the model writes its line of code unmasked), and the rest is the schema's (which has no room for a newline:
    no whitespace between JSON tokens). Greedy, so every engine setup writes the same; drafts of the n-gram
    proposer stop short of the end tag."""
    from kestrel import LLM
    from kestrel.sampling_params import ThinkingTags

    llm = LLM(max_model_len=256, **engine_args)
    tokenizer = llm.get_tokenizer()
    (newline,) = tokenizer.encode("\n", add_special_tokens=False)
    (start,) = tokenizer.encode("<", add_special_tokens=False)
    tags = ThinkingTags(start, newline, open=True)
    prompt = "import os\nimport os\nimport os\nimport"  # the n-gram drafts of " os" hold the newline
    params = constrained(0, 0.0, max_tokens=120, json=PERSON, disable_any_whitespace=True)
    params = params.replace(structured_outputs=dataclasses.replace(params.structured_outputs, after_thinking=tags))
    (out,) = llm.generate(prompt, params, use_tqdm=False)[0].outputs
    thought, answer = out.text.split("\n", 1)
    assert out.finish_reason == "stop", out.text
    assert thought.strip() and not thought.lstrip().startswith("{")
    jsonschema.validate(json.loads(answer), PERSON)
    assert not getattr(llm.engine.structured, "_matchers", None) and not llm.engine._thinking
    unconstrained = llm.generate(prompt, params.replace(structured_outputs=None), use_tqdm=False)[0].outputs[0]
    assert unconstrained.text.startswith(thought + "\n")  # the thinking is what the model writes unmasked


def test_think_tag_ids_past_the_vocabulary_are_refused(llm):
    from kestrel.sampling_params import ThinkingTags

    spec = StructuredOutputsParams(json=PERSON, after_thinking=ThinkingTags(1, 10 ** 6, open=True))
    with pytest.raises(InvalidRequestError) as error:
        llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=spec), use_tqdm=False)
    assert error.value.param == "structured_outputs.after_thinking"
    assert llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished  # the engine goes on
