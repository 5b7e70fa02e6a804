"""kestrel.bench.serve metric functions against hand-computed oracles and numpy."""

import argparse
import math
import random
import statistics

import numpy as np
import pytest

from kestrel.bench.serve import (
    Level,
    RequestRecord,
    apply_chunk,
    arrival_offsets,
    client_warning,
    completion_payload,
    compute_metrics,
    is_token_chunk,
    make_prompts,
    normalize_base_url,
    parse_levels,
    parse_token_range,
    percentile,
    register,
    request_latencies,
    run,
    sse_data,
    summarize_ms,
)


def rec(index: int, start: float, chunks: list[float], end: float | None, *, usage: int | None = None,
        prompt: int = 8, max_tokens: int = 4, error: str | None = None, usage_prompt: int | None = None
        ) -> RequestRecord:
    return RequestRecord(index=index, start=start, prompt_tokens=prompt, max_tokens=max_tokens, chunk_times=chunks,
                         end=end, usage_completion_tokens=usage, usage_prompt_tokens=usage_prompt,
                         status=None if error and error.startswith("Connect") else 200, error=error)


# ------------------------------------------------------------------------------------------------ percentiles


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy_linear(n):
    rng = random.Random(n)
    values = [rng.expovariate(3.0) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-15)


def test_percentile_hand_values():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([10.0, 20.0], 90) == pytest.approx(19.0)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_ms_against_numpy():
    rng = random.Random(1)
    values = [rng.uniform(0.001, 0.5) for _ in range(257)]
    s = summarize_ms(values)
    ms = np.array(values) * 1e3
    assert s["count"] == 257
    assert s["mean"] == pytest.approx(ms.mean())
    assert s["std"] == pytest.approx(ms.std())
    assert s["median"] == pytest.approx(np.median(ms))
    assert s["p90"] == pytest.approx(np.percentile(ms, 90))
    assert s["p99"] == pytest.approx(np.percentile(ms, 99))


def test_summarize_ms_empty_is_none():
    assert summarize_ms([]) == {"count": 0, "mean": None, "std": None, "median": None, "p90": None, "p99": None}


# ------------------------------------------------------------------------------------------------ metrics


def synthetic_records() -> list[RequestRecord]:
    return [
        # ttft 100 ms, e2e 300 ms, 3 tokens from usage: tpot (300 - 100) / 2 = 100 ms, gaps 50 and 100 ms
        rec(0, 0.0, [0.10, 0.15, 0.25], 0.30, usage=3, max_tokens=3),
        # no usage: 4 tokens counted from chunks; ttft 200, e2e 300, tpot 100 / 3 ms, gaps 20, 20, 20 ms
        rec(1, 0.05, [0.25, 0.27, 0.29, 0.31], 0.35),
        # one token: no TPOT, no gap; ttft = e2e = 100 ms (the [DONE] arrives with the only chunk)
        rec(2, 0.10, [0.20], 0.20, usage=1, usage_prompt=9),
        # two tokens per chunk: usage says 6 over 3 chunks; ttft 400, e2e 1000, tpot 600 / 5 = 120 ms, gaps 200, 300
        rec(3, 1.0, [1.4, 1.6, 1.9], 2.0, usage=6, max_tokens=6),
        # HTTP error before any chunk
        rec(4, 0.0, [], None, error="HTTP 503: busy"),
        # connection dropped mid-stream: it streamed chunks, yet is a failure and must not be measured
        rec(5, 0.0, [0.01, 0.02], None, error="RemoteProtocolError: peer closed"),
        # the same HTTP error again, to check the error tally
        rec(6, 0.3, [], None, error="HTTP 503: busy"),
        # a stream that ended without [DONE]
        rec(7, 0.0, [0.5], None),
    ]


def test_request_latencies_hand_values():
    ttft, e2e, tpot, itl = request_latencies(synthetic_records()[0])
    assert (ttft, e2e) == pytest.approx((0.10, 0.30))
    assert tpot == pytest.approx(0.10)
    assert itl == pytest.approx([0.05, 0.10])
    _, _, tpot1, itl1 = request_latencies(synthetic_records()[2])
    assert tpot1 is None and itl1 == []
    with pytest.raises(ValueError):
        request_latencies(synthetic_records()[4])


def test_compute_metrics_against_hand_oracle():
    m = compute_metrics(synthetic_records(), duration=2.0)
    assert m["completed"] == 4 and m["failed"] == 4
    assert m["duration_s"] == 2.0
    assert m["total_input_tokens"] == 8 + 8 + 9 + 8  # usage prompt_tokens wins where present
    assert m["total_output_tokens"] == 3 + 4 + 1 + 6
    assert m["request_throughput"] == pytest.approx(4 / 2.0)
    assert m["output_throughput"] == pytest.approx(14 / 2.0)
    assert m["total_token_throughput"] == pytest.approx((33 + 14) / 2.0)
    assert m["short_outputs"] == 1  # request 2 returned 1 of its 4 max_tokens

    oracle = {
        "ttft_ms": [100, 200, 100, 400],
        "e2e_ms": [300, 300, 100, 1000],
        "tpot_ms": [100, 100 / 3, 120],
        "itl_ms": [50, 100, 20, 20, 20, 200, 300],
    }
    for name, values in oracle.items():
        s = m[name]
        assert s["count"] == len(values), name
        assert s["mean"] == pytest.approx(statistics.fmean(values)), name
        assert s["median"] == pytest.approx(float(np.median(values))), name
        assert s["p90"] == pytest.approx(float(np.percentile(values, 90))), name
        assert s["p99"] == pytest.approx(float(np.percentile(values, 99))), name
        assert s["std"] == pytest.approx(float(np.std(values))), name
    assert m["itl_ms"]["median"] == pytest.approx(50.0)
    assert m["errors"] == {"HTTP 503: busy": 2, "RemoteProtocolError: peer closed": 1,
                           "no text chunk or no [DONE]": 1}


def test_failed_requests_change_counts_not_latencies():
    good = synthetic_records()[:4]
    with_failures = compute_metrics(synthetic_records(), duration=2.0)
    only_good = compute_metrics(good, duration=2.0)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "total_output_tokens", "request_throughput"):
        assert with_failures[key] == only_good[key], key
    assert only_good["failed"] == 0 and only_good["errors"] == {}


def test_all_failed():
    m = compute_metrics([rec(0, 0.0, [], None, error="ConnectError: refused")], duration=0.5)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["request_throughput"] == 0 and m["output_throughput"] == 0
    assert m["ttft_ms"]["mean"] is None and m["itl_ms"]["count"] == 0


def test_bad_duration():
    with pytest.raises(ValueError):
        compute_metrics([], duration=0.0)


# ------------------------------------------------------------------------------------------------ stream parsing


def test_sse_data():
    assert sse_data('data: {"a": 1}') == '{"a": 1}'
    assert sse_data("data:[DONE]") == "[DONE]"
    assert sse_data("") is None
    assert sse_data(": ping") is None
    assert sse_data("event: x") is None


def chunk(text, finish=None, usage=None):
    choices = [] if text is None else [{"text": text, "index": 0, "finish_reason": finish}]
    return {"id": "c", "object": "text_completion", "choices": choices, "usage": usage}


def test_token_chunks():
    assert is_token_chunk(chunk("a"))
    assert is_token_chunk(chunk("a", finish="length"))
    assert is_token_chunk(chunk(""))  # detokenizer held the text back; the step still happened
    assert not is_token_chunk(chunk("", finish="stop"))  # closing marker only
    assert not is_token_chunk(chunk(None, usage={"completion_tokens": 3}))
    assert not is_token_chunk({"choices": [{"index": 0}]})


def test_apply_chunk_sequence():
    r = RequestRecord(index=0, start=0.0, prompt_tokens=4, max_tokens=3)
    apply_chunk(r, chunk("he"), 0.1)
    apply_chunk(r, chunk(""), 0.2)
    apply_chunk(r, chunk("llo", finish="length"), 0.3)
    apply_chunk(r, chunk(None, usage={"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}), 0.31)
    assert r.chunk_times == [0.1, 0.2, 0.3]
    assert r.output_tokens == 3 and r.input_tokens == 5 and r.error is None
    apply_chunk(r, {"error": {"message": "boom", "type": "internal"}}, 0.4)
    assert r.error and "boom" in r.error


# ------------------------------------------------------------------------------------------------ workload


def test_arrival_offsets_poisson():
    offsets = arrival_offsets(20000, 50.0, seed=3)
    assert offsets[0] == 0.0 and len(offsets) == 20000
    gaps = np.diff(offsets)
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 50.0, rel=0.05)  # exponential: std = mean
    assert arrival_offsets(5, 50.0, seed=3) == offsets[:5]
    assert arrival_offsets(5, 50.0, seed=4) != offsets[:5]
    assert arrival_offsets(4, math.inf, seed=3) == [0.0] * 4
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, seed=0)


def test_make_prompts():
    prompts = make_prompts(6, 17, (5, 9), seed="s")
    assert len(prompts) == 6 and all(len(p) == 17 for p in prompts)
    assert all(5 <= t < 9 for p in prompts for t in p)
    assert make_prompts(6, 17, (5, 9), seed="s") == prompts
    assert make_prompts(6, 17, (5, 9), seed="t") != prompts
    with pytest.raises(ValueError):
        make_prompts(1, 3, (4, 4), seed=0)


def test_payload():
    p = completion_payload("m", [1, 2], 7, ignore_eos=True)
    assert p == {"model": "m", "prompt": [1, 2], "max_tokens": 7, "temperature": 0.0, "stream": True,
                 "stream_options": {"include_usage": True}, "ignore_eos": True}
    assert "ignore_eos" not in completion_payload("m", [1], 1, ignore_eos=False)


def test_parse_levels_and_ranges():
    assert parse_levels("1,4,16", None, None) == [Level(concurrency=c) for c in (1, 4, 16)]
    levels = parse_levels(None, "2.5,inf", 8)
    assert levels[0] == Level(request_rate=2.5, max_concurrency=8) and math.isinf(levels[1].request_rate)
    assert levels[1].to_json()["request_rate"] == "inf"
    assert Level(concurrency=64).pool_size(10) == 10 and Level(request_rate=1.0).pool_size(30) == 30
    for bad in (("0", None), (None, "-1"), ("1", "1"), (None, None)):
        with pytest.raises(ValueError):
            parse_levels(*bad, None)
    assert parse_token_range(None, 1000) == (0, 1000)
    assert parse_token_range("100:200", 1000) == (100, 200)
    with pytest.raises(ValueError):
        parse_token_range("100", 1000)
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    assert normalize_base_url("http://h:1") == "http://h:1"


def test_register_adds_serve_subcommand():
    parser = argparse.ArgumentParser(prog="kestrel bench")
    register(parser.add_subparsers(dest="suite", required=True))
    args = parser.parse_args(["serve", "--base-url", "http://127.0.0.1:1", "--request-rate", "inf",
                              "--max-concurrency", "2", "--num-prompts", "3", "--input-len", "4", "--output-len", "5",
                              "--ignore-eos"])
    assert args.func is run and args.ignore_eos and args.max_concurrency == 2


def test_bad_arguments_exit_2():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="suite"))
    base = ["serve", "--base-url", "http://127.0.0.1:1", "--num-prompts", "3", "--input-len", "4",
            "--output-len", "5"]
    assert run(parser.parse_args([*base, "--concurrency", "0"])) == 2
    assert run(parser.parse_args([*base, "--concurrency", "2", "--max-concurrency", "1"])) == 2
    assert run(parser.parse_args([*base, "--concurrency", "2", "--token-ids", "9:3"])) == 2


def test_client_warning_thresholds():
    calm = {"cpu_utilization": 0.2, "loop_lag_ms": summarize_ms([0.0005, 0.001])}
    assert client_warning(calm) is None
    assert client_warning({"cpu_utilization": 0.2, "loop_lag_ms": summarize_ms([])}) is None
    assert "busy" in client_warning({**calm, "cpu_utilization": 0.95})
    assert "busy" in client_warning({**calm, "loop_lag_ms": summarize_ms([0.001, 0.05])})
