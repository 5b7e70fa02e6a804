"""The periodic engine line (vLLM's wording): rates over the interval, queue sizes, KV usage, prefix hit rate;
LLM(disable_log_stats=False) logs it, the default stays quiet."""

import logging
from types import SimpleNamespace

import pytest

from kestrel import LLM, SamplingParams
from kestrel.engine.stats_logger import StatsLogger


def scheduler(prompt, generated, queries, hits, running=3, waiting=1, usage=0.25):
    return SimpleNamespace(stats=SimpleNamespace(num_prompt_tokens=prompt, num_generation_tokens=generated),
                           kv=SimpleNamespace(prefix_queries=queries, prefix_hits=hits, usage=usage),
                           num_running=running, num_waiting=waiting)


def test_rates_are_over_the_interval_and_logged_once_per_interval():
    now = [0.0]
    lines = []
    stats = StatsLogger(interval_s=10.0, log=lines.append, clock=lambda: now[0])
    now[0] = 5.0
    assert stats.maybe_log(scheduler(100, 50, 10, 5)) is None  # inside the interval
    now[0] = 10.0
    line = stats.maybe_log(scheduler(1000, 200, 100, 25))
    assert line == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 3 "
                    "reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    now[0] = 12.0
    forced = stats.maybe_log(scheduler(1000, 300, 100, 25), force=True)
    assert forced.startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 50.0 tokens/s")
    now[0] = 13.0
    assert stats.maybe_log(scheduler(1000, 300, 100, 25), force=True) is None  # nothing happened since
    assert lines == [line, forced]


def test_llm_logs_stats_only_when_asked(tiny_checkpoint, caplog):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="kestrel.engine"):
        quiet = LLM(tiny_checkpoint, dtype="float32", max_model_len=64)
        assert quiet._stats_logger is None
        loud = LLM(tiny_checkpoint, dtype="float32", max_model_len=64, disable_log_stats=False)
        loud._stats_logger.interval_s = 0.0
        loud.generate([{"prompt_token_ids": [3, 4]}] * 2, params, use_tqdm=False)
    assert any("Avg generation throughput" in r.message for r in caplog.records)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from kestrel.loader.model_init import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("stats")
    write_tiny_checkpoint(str(path), arch="llama", seed=1)
    return str(path)
