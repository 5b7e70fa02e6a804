"""End to end on the CPU: the fast CPU paths (`kernels/cpu/`) give the same greedy tokens as the references they
replace, on kestrel-tiny (mixed prefill and decode steps, chunked prefill) and on a Gemma 2 shape (sliding window,
logit soft cap)."""

from __future__ import annotations

import random

import pytest

from kestrel import LLM, SamplingParams, ops
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.tiny import default_model_path


def _prompts(vocab: int, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 70))]}
            for _ in range(count)]


def _greedy_both_ways(llm: LLM, prompts: list[dict], max_new: int) -> tuple[list, list]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with ops.cpu_references():
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return fast, ref


def test_kestrel_tiny_greedy_identical_to_references() -> None:
    # A small token budget so steps mix prefill chunks with decodes.
    llm = LLM(str(default_model_path()), dtype="float32", max_model_len=256, max_num_batched_tokens=96,
              max_num_seqs=12, enable_prefix_caching=False)
    fast, ref = _greedy_both_ways(llm, _prompts(llm.runner.vocab_size, 12, seed=3), max_new=24)
    assert fast == ref


@pytest.mark.parametrize("arch", ["gemma2"])
def test_window_and_soft_cap_greedy_identical(tmp_path, arch: str) -> None:
    write_tiny_checkpoint(str(tmp_path), arch=arch, seed=4, sliding_window=8)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_batched_tokens=64, max_num_seqs=8)
    fast, ref = _greedy_both_ways(llm, _prompts(llm.runner.vocab_size, 8, seed=5), max_new=16)
    assert fast == ref
