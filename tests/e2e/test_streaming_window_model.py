"""Attention sinks + window (streaming_window) end to end on a tiny random Llama: greedy identity with the dense
path while the sequence fits sinks + window, a 5,000-token generation past a 512-token context in bounded KV with
the dropped blocks reused, preemption mid-stream recomputing only the cache's tokens, and the config errors."""

from __future__ import annotations

import pytest

from kestrel import LLM, SamplingParams
from kestrel.config import ConfigError
from kestrel.engine.contracts import run_step
from kestrel.kv_spec import SinkWindowSpec
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.request import InvalidRequestError, RequestStatus

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama-stream")
    write_tiny_checkpoint(str(path), arch="llama", seed=11, max_position_embeddings=512)
    return str(path)


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 250 + 3 for i in range(n)]


def test_greedy_equals_dense_within_sinks_plus_window(tiny_dir: str) -> None:
    prompts = [_prompt(40, 1), _prompt(7, 2), _prompt(90, 3)]
    dense = _greedy(LLM(tiny_dir, dtype="float32", max_model_len=256, kv_cache_blocks=64), prompts, 60)
    stream = LLM(tiny_dir, dtype="float32", max_model_len=256, kv_cache_blocks=64,
                 streaming_window={"sink_tokens": 4, "window": 160})
    assert stream.runner.kv_layout.groups[0].spec == SinkWindowSpec(2, 16, window=160, sink_tokens=4)
    assert _greedy(stream, prompts, 60) == dense  # 150 tokens at most: within 4 + 160
    # ... and it departs from dense once the window slides (the sinks and window change what is read)
    assert _greedy(LLM(tiny_dir, dtype="float32", max_model_len=256, kv_cache_blocks=64,
                       streaming_window={"sink_tokens": 4, "window": 40}), prompts[:1], 60) != dense[:1]


def test_long_generation_runs_in_bounded_kv(tiny_dir: str) -> None:
    streaming = {"sink_tokens": 4, "window": 100}
    llm = LLM(tiny_dir, dtype="float32", max_model_len=256, kv_cache_blocks=40, streaming_window=streaming,
              max_num_seqs=2)
    engine = llm.engine
    pool = engine.scheduler.kv.pool
    bound = SinkWindowSpec(1, 1, window=100, sink_tokens=4).max_blocks_per_request(BLOCK)
    engine.add_request("stream", _prompt(30, 5), SamplingParams(temperature=0.0, max_tokens=2500, ignore_eos=True))
    peak, seen_ids, steps = 0, set(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        in_use = pool.num_blocks - pool.num_free_blocks
        peak = max(peak, in_use)
        request = engine.scheduler.requests.get("stream")
        if request is not None:
            ids = engine.scheduler.kv.block_ids("stream")[0]
            seen_ids.update(ids)
            assert len(ids) <= bound and request.num_kv_tokens <= bound * BLOCK
    assert steps >= 2500 and peak <= bound  # 2,530 tokens, ten times the 256-token context
    assert pool.num_free_blocks == pool.num_blocks  # everything back at the end
    # 159 blocks' worth of tokens went through 40 blocks: the dropped ones were reused
    assert len(seen_ids) <= 40


def test_preemption_recomputes_only_the_cache(tiny_dir: str) -> None:
    """Preempted after its window slid, a stream is recomputed from its cache's tokens alone (the sink blocks' and the
    window's, at their cache positions), and runs on to its last token in bounded KV."""
    streaming = {"sink_tokens": 16, "window": 64}
    llm = LLM(tiny_dir, dtype="float32", max_model_len=128, kv_cache_blocks=40, streaming_window=streaming)
    engine, scheduler = llm.engine, llm.engine.scheduler
    engine.add_request("stream", _prompt(20, 9), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    request = scheduler.requests["stream"]
    for _ in range(200):
        engine.step()
        if request.num_dropped_tokens:
            break
    assert request.num_dropped_tokens and request.num_tokens > 80
    kept = request.num_kv_tokens
    victim = scheduler.running.pop()
    assert victim is request
    scheduler._preempt(victim)
    output = scheduler.schedule()
    assert [n.req_id for n in output.new_requests] == ["stream"]
    new = output.new_requests[0]
    # the recomputation covers the cache's tokens only, from cache position 0
    assert output.num_scheduled_tokens["stream"] == kept and new.num_computed_tokens == 0
    assert new.num_dropped_tokens == request.num_dropped_tokens and len(new.block_ids[0]) == -(-kept // BLOCK)
    scheduler.update(output, run_step(llm.runner, output))
    bound = SinkWindowSpec(1, 1, window=64, sink_tokens=16).max_blocks_per_request(BLOCK)
    while engine.has_unfinished_requests():
        engine.step()
        assert len(scheduler.kv.block_ids("stream")[0]) <= bound
    assert request.status == RequestStatus.FINISHED_LENGTH and request.num_output_tokens == 200
    assert request.num_preemptions == 1


def test_config_errors(tiny_dir: str) -> None:
    with pytest.raises(ConfigError, match="streaming_window.window"):
        LLM(tiny_dir, max_model_len=128, streaming_window={"sink_tokens": 4, "window": 125})
    with pytest.raises(ConfigError, match="unknown keys"):
        LLM(tiny_dir, max_model_len=128, streaming_window={"sinks": 4, "window": 16})
    with pytest.raises(ConfigError, match="streaming_window.window"):
        LLM(tiny_dir, max_model_len=128, streaming_window={"sink_tokens": 4})
    with pytest.raises(ConfigError, match="streaming_window.sink_tokens"):
        LLM(tiny_dir, max_model_len=128, streaming_window={"sink_tokens": -1, "window": 16})
    with pytest.raises(ConfigError, match="sparse_decode"):
        LLM(tiny_dir, max_model_len=128, streaming_window={"window": 64},
            sparse_decode={"method": "quest", "token_budget": 64})
    with pytest.raises(ConfigError, match="speculative_config"):
        LLM(tiny_dir, max_model_len=128, streaming_window={"window": 64},
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="kv_cache_blocks"):
        LLM(tiny_dir, max_model_len=128, streaming_window={"sink_tokens": 4, "window": 120}, kv_cache_blocks=8)
    llm = LLM(tiny_dir, max_model_len=128, streaming_window={"sink_tokens": 4, "window": 60}, kv_cache_blocks=16)
    with pytest.raises(InvalidRequestError, match="at most 64 tokens"):
        _greedy(llm, [_prompt(65, 1)], 1)
    assert len(_greedy(llm, [_prompt(64, 1)], 100)[0]) == 100  # 164 tokens past max_model_len=128
