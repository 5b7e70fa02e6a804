"""Speculative decoding (n-gram proposals) is lossless: greedy outputs equal decoding without it (random models
and kestrel-tiny, float32, under chunked prefill and preemption), and rejection sampling leaves the target
distribution as it is (a chi-square test over many seeded draws on a small vocabulary)."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from kestrel import SamplingParams
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.sample.sampler import Sampler, SamplingMetadata
from kestrel.sample.spec_verify import verify

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
REPETITIVE = ["def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
              "import os\nimport sys\nimport os\nimport sys\nimport os\n", "x = [1, 2, 3, 1, 2, 3, 1, 2"]


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec-random")
    write_tiny_checkpoint(str(path), arch="llama", seed=11)
    return str(path)


def greedy(llm, prompts, max_tokens=48):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("which", ["kestrel-tiny", "random"])
def test_greedy_outputs_are_identical_with_and_without_speculation(random_model, which):
    from kestrel import LLM

    model = None if which == "kestrel-tiny" else random_model
    # Random weights repeat themselves under greedy decoding too, so n-grams find proposals on both.
    prompts = REPETITIVE + ["class Stack:\n    def push(self, item):\n"]
    plain = greedy(LLM(model, dtype="float32", max_model_len=256), prompts)
    spec = LLM(model, dtype="float32", max_model_len=256, speculative_config=NGRAM)
    assert greedy(spec, prompts) == plain
    stats = spec.stats
    assert stats.num_spec_draft_tokens > 0 and 0 < stats.num_spec_accepted_tokens <= stats.num_spec_draft_tokens
    assert not spec.engine.has_unfinished_requests()


def test_lossless_under_chunked_prefill_preemption_and_async_scheduling():
    from kestrel import LLM

    prompts = REPETITIVE * 2
    plain = greedy(LLM(dtype="float32", max_model_len=128), prompts, max_tokens=40)
    # A tiny KV cache and token budget: prompts are chunked and requests preempted while they speculate.
    spec = LLM(dtype="float32", max_model_len=128, kv_cache_blocks=12, max_num_batched_tokens=16, max_num_seqs=6,
               async_scheduling=True, speculative_config=NGRAM)
    assert greedy(spec, prompts, max_tokens=40) == plain
    assert spec.stats.num_preemptions > 0 and spec.stats.num_spec_accepted_tokens > 0
    assert spec.engine.scheduler.kv.pool.num_free_blocks == 12


def test_seeded_sampling_is_reproducible_and_stops_where_it_should():
    from kestrel import LLM

    spec = LLM(dtype="float32", max_model_len=256, speculative_config=NGRAM)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=40, stop=["\n\n\n"])
    first = spec.generate(REPETITIVE, params, use_tqdm=False)
    again = spec.generate(REPETITIVE, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    capped = spec.generate(REPETITIVE[0], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert len(capped.token_ids) == 7  # drafts never run past max_tokens


def test_rejection_sampling_keeps_the_target_distribution():
    vocab, trials = 8, 6000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g) * 1.5  # positions 0..2 of one request with two drafts
    drafts = [2, 5]
    temperature = 0.9
    params = SamplingParams(temperature=temperature, top_k=6)
    first, second_after_draft = np.zeros(vocab), np.zeros(vocab)
    for trial in range(trials):
        gen = torch.Generator().manual_seed(trial)
        meta = SamplingMetadata.build([params] * 3, [[]] * 3, [[]] * 3, [gen] * 3, frozenset(), vocab, "cpu")
        out = verify(logits.clone(), meta, torch.tensor([*drafts, -1]), [2], Sampler())
        accepted = int(out.num_accepted[0])
        tokens = drafts[:accepted] + [int(out.tokens[accepted])]
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            second_after_draft[tokens[1]] += 1

    def target(row):
        kept = logits[row] / temperature
        kth = kept.topk(6).values[-1]
        return torch.softmax(kept.masked_fill(kept < kth, float("-inf")), dim=-1).double().numpy()

    for counts, p in ((first, target(0)), (second_after_draft, target(1))):
        support = p > 0
        assert counts[~support].sum() == 0  # nothing outside top-k
        expected = p[support] / p[support].sum() * counts.sum()
        assert chisquare(counts[support], expected).pvalue > 1e-3, (counts, expected)


@pytest.mark.parametrize("settings", [dict(repetition_penalty=1.3), dict(presence_penalty=0.8, frequency_penalty=0.5),
                                      dict(min_tokens=20), dict(bad_words=["add"])],
                         ids=["repetition", "presence-frequency", "min_tokens", "bad_words"])
def test_history_dependent_settings_stay_lossless(settings):
    from kestrel import LLM

    params = SamplingParams(temperature=0.0, max_tokens=40, **settings)
    plain = LLM(dtype="float32", max_model_len=256)
    spec = LLM(dtype="float32", max_model_len=256, speculative_config=NGRAM)
    expected = [o.outputs[0].token_ids for o in plain.generate(REPETITIVE, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(REPETITIVE, params, use_tqdm=False)] == expected
    assert spec.stats.num_spec_draft_tokens > 0


def test_constrained_requests_speculate_with_drafts_the_grammar_allows():
    import json

    import jsonschema

    from kestrel import LLM
    from kestrel.sampling_params import StructuredOutputsParams

    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 16,
              "maxItems": 40}
    prompt = "digits = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]\nmore = "
    params = [SamplingParams(temperature=t, seed=s, max_tokens=120, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True)) for t, s in ((0.0, 0), (0.9, 1), (1.2, 2))]
    plain = LLM(dtype="float32", max_model_len=256).generate([prompt] * 3, params, use_tqdm=False)
    spec = LLM(dtype="float32", max_model_len=256, speculative_config=NGRAM)
    outputs = spec.generate([prompt] * 3, params, use_tqdm=False)
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert outputs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids  # greedy: lossless
    assert spec.stats.num_spec_accepted_tokens > 0 and not spec.engine.structured._matchers


def test_logprobs_match_decoding_without_speculation():
    """Requests asking for logprobs speculate too, and each emitted token's entry (its logprob, rank and the top
    candidates) is the target's at that position, as without speculation."""
    from kestrel import LLM

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    plain = LLM(dtype="float32", max_model_len=256).generate(REPETITIVE, params, use_tqdm=False)
    spec = LLM(dtype="float32", max_model_len=256, speculative_config=NGRAM)
    got = spec.generate(REPETITIVE, params, use_tqdm=False)
    assert spec.stats.num_spec_accepted_tokens > 0
    for a, b in zip(got, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for entries_a, entries_b in ((a.outputs[0].logprobs, b.outputs[0].logprobs),
                                     (a.prompt_logprobs, b.prompt_logprobs)):
            assert len(entries_a) == len(entries_b)
            for ea, eb in zip(entries_a, entries_b):
                if eb is None:
                    assert ea is None
                    continue
                assert list(ea) == list(eb)  # the emitted token first, then the same top candidates
                for token_id in eb:
                    assert ea[token_id].rank == eb[token_id].rank
                    assert ea[token_id].logprob == pytest.approx(eb[token_id].logprob, abs=1e-4)
