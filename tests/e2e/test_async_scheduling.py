"""Async scheduling (step N+1 launched before step N's tokens reach the host) gives the same results as the
synchronous engine: greedy parity with HF transformers, chunking, preemption, EOS and stop strings, seeds,
logprobs, n > 1, aborts, and no leaked blocks."""

import random

import pytest
from test_generate import hf_greedy, kestrel_greedy, mixed_prompts

from kestrel import LLM, SamplingParams
from kestrel.engine.core import EngineCore
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.tiny import default_model_path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-async")
    write_tiny_checkpoint(str(path), arch="llama", seed=2)
    return str(path)


def all_blocks_free(llm: LLM) -> bool:
    """Blocks, the worker's rows and its per-request state are all released once generate returns."""
    pool = llm.engine.scheduler.kv.pool
    return (pool.num_free_blocks == pool.num_blocks and not llm.engine.has_unfinished_requests()
            and not llm.runner.requests and llm.runner.block_table.num_rows_in_use == 0)


def test_greedy_matches_hf_with_chunking_and_preemption(llama_dir):
    prompts = mixed_prompts(1000, seed=3)
    expected = hf_greedy(llama_dir, prompts)
    plain = LLM(llama_dir, dtype="float32", max_model_len=64, async_scheduling=True)
    assert kestrel_greedy(plain, prompts) == expected
    chunked = LLM(llama_dir, dtype="float32", max_model_len=64, max_num_batched_tokens=8, max_num_seqs=8,
                  async_scheduling=True)
    assert kestrel_greedy(chunked, prompts) == expected
    tight = LLM(llama_dir, dtype="float32", max_model_len=64, kv_cache_blocks=6, max_num_seqs=16,
                async_scheduling=True)
    assert kestrel_greedy(tight, prompts) == expected
    assert tight.stats.num_preemptions > 0
    for llm in (plain, chunked, tight):
        assert all_blocks_free(llm)


@pytest.fixture(scope="module")
def tiny_pair():
    """The trained kestrel-tiny (it emits EOS and newlines), synchronous and async."""
    path = str(default_model_path())
    return (LLM(path, max_model_len=256, max_num_seqs=8),
            LLM(path, max_model_len=256, max_num_seqs=8, async_scheduling=True))


PROMPTS = ["def __init__(self", "import os", "class Config:", "for i in range(10):", "x = [", "return",
           "if __name__ ==", "with open("]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=40),  # EOS ends some requests at unknown times
    SamplingParams(temperature=0.0, max_tokens=40, stop=["\n"]),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=30, seed=11, logprobs=3),
    SamplingParams(temperature=0.7, max_tokens=20, seed=5, n=3),
    SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, min_tokens=4),  # runs synchronously
], ids=["greedy-eos", "stop-string", "seeded-logprobs", "n3", "penalties"])
def test_async_outputs_equal_sync_outputs(tiny_pair, params):
    sync, asynchronous = tiny_pair
    expected = sync.generate(PROMPTS, params, use_tqdm=False)
    got = asynchronous.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(expected, got):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (y.token_ids, y.text, y.finish_reason, y.stop_reason) == (x.token_ids, x.text, x.finish_reason,
                                                                             x.stop_reason)
            if params.logprobs is not None:
                assert [sorted(e) for e in y.logprobs] == [sorted(e) for e in x.logprobs]
    assert {c.finish_reason for o in got for c in o.outputs} <= {"stop", "length"}
    assert all_blocks_free(asynchronous)


def test_async_abort_mid_run_frees_everything(tiny_pair):
    _, llm = tiny_pair
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", tokenizer.encode(prompt), params)
    for _ in range(5):
        engine.step()
    assert engine._batch_queue  # a step is in flight while we abort
    engine.abort_request([f"abort-{i}" for i in range(0, len(PROMPTS), 2)])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == sorted(f"abort-{i}" for i in range(1, len(PROMPTS), 2))
    assert all(len(o.outputs[0].token_ids) == 50 for o in finished.values())
    assert all_blocks_free(llm)


def test_async_needs_a_runner_with_the_two_verbs():
    class OneVerb:
        def execute(self, scheduler_output):
            raise AssertionError("not reached")

    from kestrel.config import EngineConfig

    config = EngineConfig.from_kwargs(str(default_model_path()), async_scheduling=True, max_model_len=64)
    with pytest.raises(TypeError, match="execute_model"):
        EngineCore(config, OneVerb(), 16, tokenizer=None, eos_token_id=None)


def test_random_greedy_mix_under_async_keeps_max_tokens(llama_dir):
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    llm = LLM(llama_dir, dtype="float32", max_model_len=64, max_num_seqs=5, async_scheduling=True)
    lengths = [rng.randrange(1, 12) for _ in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    # each request's tokens equal its own synchronous greedy run
    sync = LLM(llama_dir, dtype="float32", max_model_len=64, max_num_seqs=5)
    expected = sync.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert all_blocks_free(llm)


def test_a_drained_batch_then_a_burst_of_chunked_prefills(llama_dir):
    """A full batch finishes on its in-flight tokens, then a burst larger than max_num_seqs is admitted while
    its prompts are prefilled in chunks: the worker's rows are released before they are reused, and the
    burst's outputs equal the synchronous engine's."""
    rng = random.Random(4)
    llm = LLM(llama_dir, dtype="float32", max_model_len=64, max_num_seqs=6, max_num_batched_tokens=48,
              async_scheduling=True)
    sync = LLM(llama_dir, dtype="float32", max_model_len=64, max_num_seqs=6, max_num_batched_tokens=48)
    for count, max_tokens in [(6, 4), (30, 10), (6, 3)]:
        prompts = [{"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(40)]} for _ in range(count)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert all_blocks_free(llm)
        expected = sync.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
