"""LLM.beam_search against a float64 beam search run on Hugging Face transformers' own logits, with vLLM's
rules: 2 x beam_width candidates per beam, beams ending in EOS are complete, the result ranked by
cum_logprob / length ** length_penalty (the length counts the prompt, not a final EOS)."""

import pytest
import torch
import transformers

from kestrel import BeamSearchParams
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.sampling_params import SamplingParams, SamplingParamsError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("beam")
    write_tiny_checkpoint(str(path), arch="llama", seed=21)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dir):
    from kestrel import LLM

    return LLM(model_dir, dtype="float32", max_model_len=64)


def reference_beam_search(model, prompt: list[int], width: int, max_tokens: int, eos: int, length_penalty: float,
                          ignore_eos: bool = False) -> list[tuple[list[int], float]]:
    live = [(list(prompt), 0.0)]
    complete = []
    for _ in range(max_tokens):
        extended = []
        for tokens, score in live:
            with torch.inference_mode():
                logits = model(torch.tensor([tokens])).logits[0, -1].double()
            logprobs = torch.log_softmax(logits, dim=-1)
            top = logprobs.topk(2 * width)
            for lp, token in zip(top.values.tolist(), top.indices.tolist()):
                child = (tokens + [token], score + lp)
                (complete if token == eos and not ignore_eos else extended).append(child)
        live = sorted(extended, key=lambda b: b[1], reverse=True)[:width]
        if not live:
            break

    def ranked(beam):
        tokens, score = beam
        return score / ((len(tokens) - (tokens[-1] == eos)) ** length_penalty)

    return sorted(complete + live, key=ranked, reverse=True)[:width]


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (3, 1.0), (2, 0.5)])
def test_beams_match_a_float64_reference(llm, model_dir, width, length_penalty):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = llm.engine.eos_token_id
    prompts = ["def f(x):", "import os"]
    params = BeamSearchParams(beam_width=width, max_tokens=5, length_penalty=length_penalty)
    outputs = llm.beam_search(prompts, params)
    assert len(outputs) == 2
    for prompt, output in zip(prompts, outputs):
        ids = llm.tokenizer(prompt).input_ids
        expected = reference_beam_search(model, ids, width, 5, eos, length_penalty)
        assert [b.tokens for b in output.sequences] == [tokens for tokens, _ in expected]
        for beam, (_, score) in zip(output.sequences, expected):
            assert beam.cum_logprob == pytest.approx(score, abs=1e-4)
            assert beam.tokens[: len(ids)] == ids and len(beam.logprobs) == len(beam.output_token_ids)
            assert beam.text == llm.tokenizer.decode(beam.output_token_ids, skip_special_tokens=True)


def test_one_beam_is_greedy_decoding(llm):
    beam = llm.beam_search(["class A:"], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))[0]
    greedy = llm.generate("class A:", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert beam.sequences[0].output_token_ids == greedy.token_ids


def test_concurrency_limit_changes_nothing_but_the_grouping(llm):
    prompts = ["a", "b c", "d e f"]
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    together = llm.beam_search(prompts, params)
    one_at_a_time = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[b.tokens for b in o.sequences] for o in together] == [[b.tokens for b in o.sequences]
                                                                  for o in one_at_a_time]
    assert not llm.engine.has_unfinished_requests()


def test_bad_beam_settings_are_named(llm):
    from kestrel import SamplingParams
    from kestrel.request import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="takes a BeamSearchParams.*got SamplingParams"):
        llm.beam_search(["x"], SamplingParams(max_tokens=3))
    with pytest.raises(SamplingParamsError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)


def test_a_beam_that_ends_in_eos_is_complete_and_scored_without_it():
    from kestrel.entrypoints.beam_search import BeamSearch
    from kestrel.outputs import Logprob

    eos = 9
    search = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0), frozenset({eos}),
                        max_model_len=64)
    search.advance([{eos: Logprob(-0.1), 5: Logprob(-0.5), 6: Logprob(-3.0)}])
    assert [b.tokens for b in search.complete] == [[1, 2, eos]]
    assert [b.tokens for b in search.live] == [[1, 2, 5], [1, 2, 6]]
    search.advance([{7: Logprob(-0.2)}, {8: Logprob(-0.1)}])
    search.advance([{7: Logprob(-0.2)}, {8: Logprob(-0.1)}])
    assert search.done
    # Scores: [1, 2, eos] -0.1 / 2 (EOS not counted); [1, 2, 5, 7, 7] -0.9 / 5; [1, 2, 6, 8, 8] -3.2 / 5.
    ranked = search.result().sequences
    assert [b.tokens for b in ranked] == [[1, 2, eos], [1, 2, 5, 7, 7]]
    assert [b.finish_reason for b in ranked] == ["stop", "length"]


def test_complete_beams_are_kept_by_their_length_penalized_score():
    from kestrel.entrypoints.beam_search import BeamSearch
    from kestrel.outputs import Logprob

    eos = 9
    prompt = list(range(1, 9))  # 8 prompt tokens
    search = BeamSearch(prompt, BeamSearchParams(beam_width=1, max_tokens=3), frozenset({eos}), max_model_len=64)
    search.advance([{eos: Logprob(-1.0), 5: Logprob(-0.1)}])  # short: -1.0 over 8 tokens = -0.125
    search.advance([{eos: Logprob(-1.1)}])  # longer: -1.2 over 9 tokens = -0.133, so the short one wins
    best = search.result().sequences[0]
    assert best.tokens == prompt + [eos]
    search = BeamSearch(prompt, BeamSearchParams(beam_width=1, max_tokens=3), frozenset({eos}), max_model_len=64)
    search.advance([{eos: Logprob(-1.0), 5: Logprob(-0.1)}])
    search.advance([{eos: Logprob(-0.98)}])  # -1.08 over 9 tokens = -0.12 beats -0.125: it must survive
    best = search.result().sequences[0]
    assert best.tokens == prompt + [5, eos]
