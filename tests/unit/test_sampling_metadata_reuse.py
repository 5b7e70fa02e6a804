"""A decode batch that does not change builds its sampling metadata once (`StepSampler._metadata`), unless a
request's metadata reads its tokens so far (penalties, min_tokens, bad_words)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kestrel.sample.sampler import Sampler, SamplingMetadata
from kestrel.sampling_params import SamplingParams
from kestrel.worker.input_batch import CachedRequestState
from kestrel.worker.step_sampling import StepSampler

VOCAB = 50


def _state(name: str, params: SamplingParams, num_tokens: int = 6) -> CachedRequestState:
    return CachedRequestState(name, list(range(num_tokens)), 3, params, [[0]], num_tokens)


def _sampler() -> StepSampler:
    return StepSampler(torch.nn.Identity(), Sampler(), frozenset({1}), torch.device("cpu"), None, inputs=None)


def _fields(meta: SamplingMetadata) -> dict:
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}


def _assert_same(a: SamplingMetadata, b: SamplingMetadata) -> None:
    fa, fb = _fields(a), _fields(b)
    assert fa.keys() == fb.keys()
    for name in fa:
        x, y = fa[name], fb[name]
        assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), name


def test_the_same_rows_reuse_their_metadata_and_other_rows_rebuild() -> None:
    sampler = _sampler()
    rows = [_state("a", SamplingParams(temperature=0.7, top_p=0.9)), _state("b", SamplingParams(temperature=0.0)),
            _state("c", SamplingParams(temperature=1.0, top_k=5, logit_bias={3: 2.0}, seed=4))]
    first = sampler._metadata(rows, VOCAB)
    assert sampler._metadata(list(rows), VOCAB) is first  # a new list of the same requests
    _assert_same(first, SamplingMetadata.build([s.sampling_params for s in rows], [s.prompt_token_ids for s in rows],
                                               [s.output_token_ids for s in rows], [s.generator for s in rows],
                                               frozenset({1}), VOCAB, "cpu"))
    reordered = sampler._metadata([rows[1], rows[0], rows[2]], VOCAB)
    assert reordered is not first and reordered.greedy_mask.tolist() == [True, False, False]
    fewer = sampler._metadata(rows[:2], VOCAB)
    assert fewer is not reordered and fewer.temperature.shape == (2,)
    # A request that ended and came back (preempted, re-added) is a new state object with the same id: rebuilt.
    again = [rows[0], _state("b", SamplingParams(temperature=0.5))]
    assert sampler._metadata(again, VOCAB).greedy_mask.tolist() == [False, False]
    assert sampler._metadata(again, VOCAB + 1) is not sampler._metadata(again, VOCAB)


@pytest.mark.parametrize("reads_tokens", [SamplingParams(repetition_penalty=1.3), SamplingParams(min_tokens=10),
                                          SamplingParams(bad_words_token_ids=[[4, 5]], temperature=0.0)])
def test_metadata_that_reads_the_tokens_is_built_every_step(reads_tokens: SamplingParams) -> None:
    sampler = _sampler()
    rows = [_state("a", SamplingParams()), _state("b", reads_tokens)]
    first = sampler._metadata(rows, VOCAB)
    rows[1].token_ids.extend([4, 7, 4])  # the step's tokens: penalties, min_tokens and bad words see them
    second = sampler._metadata(rows, VOCAB)
    assert second is not first
    _assert_same(second, SamplingMetadata.build([s.sampling_params for s in rows], [s.prompt_token_ids for s in rows],
                                                [s.output_token_ids for s in rows], [s.generator for s in rows],
                                                frozenset({1}), VOCAB, "cpu"))
