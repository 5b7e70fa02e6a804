"""Tokenization is fair: a multi-megabyte prompt holds one tokenizer worker at most, so small requests keep a
bounded latency beside it; a tokenization past --tokenize-timeout is a 400 and its worker is replaced; /tokenize
takes at most --max-tokenize-bytes. Against `kestrel serve` (its own process, default tokenizer workers)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import API_KEY, MODEL, assert_no_stall, serve_process
from http_client import HTTP

# Latency bounds: run alone, not beside other tests (`make test` runs the `serial` ones after the rest).
pytestmark = pytest.mark.serial

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BIG_LIMIT = str(8 << 20)
_TOKENIZE_CLIENT = """
import sys, httpx
httpx.post(sys.argv[1] + "/tokenize", content=open(sys.argv[2], "rb").read(), timeout=300,
           headers={"Content-Type": "application/json", "Authorization": "Bearer " + sys.argv[3]})
"""


def _completion(base: str) -> float:
    started = time.perf_counter()
    reply = HTTP.post(f"{base}/v1/completions", headers=HEADERS, timeout=60,
                      json={"model": MODEL, "prompt": "hello there", "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    return time.perf_counter() - started


def _health(base: str) -> float:
    started = time.perf_counter()
    assert HTTP.get(f"{base}/health", timeout=60).status_code == 200
    return time.perf_counter() - started


def test_small_requests_keep_their_latency_beside_a_4_mb_tokenize(tiny_model_dir, tmp_path):
    """The issue's row: one 3.78 MB /tokenize used to hold the only worker for a minute, and other clients'
    completions timed out behind it."""
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"model": MODEL, "prompt": "def foo(x): return x\n" * 180_000}))
    with serve_process(tiny_model_dir, "--max-tokenize-bytes", BIG_LIMIT) as (_, base):
        _completion(base)  # warm
        client = subprocess.Popen([sys.executable, "-c", _TOKENIZE_CLIENT, base, str(body), API_KEY])
        try:
            time.sleep(1.0)  # the body has arrived and a worker is tokenizing it
            completions, healths = [], []
            while client.poll() is None and len(completions) < 10:
                completions.append(_completion(base))
                healths.append(_health(base))
                time.sleep(0.2)
            assert len(completions) >= 2, "the big tokenization should still run while this is measured"
        finally:
            client.kill()  # a client that goes away: its tokenization is cancelled, its worker replaced
            client.wait()
        assert_no_stall(completions, "completions beside the 4 MB tokenize", typical_s=0.5, worst_s=2.0)
        assert_no_stall(healths, "/health beside the 4 MB tokenize", typical_s=0.2, worst_s=1.0)
        time.sleep(1.0)
        assert _completion(base) <= 2.0


def test_a_tokenization_past_its_deadline_is_a_400_and_the_server_goes_on(tiny_model_dir):
    with serve_process(tiny_model_dir, "--tokenize-timeout", "0.5", "--max-tokenize-bytes", BIG_LIMIT) as (_, base):
        started = time.perf_counter()
        reply = HTTP.post(f"{base}/v1/completions", headers=HEADERS, timeout=60,
                          json={"model": MODEL, "prompt": "def foo(x): return x\n" * 60_000, "max_tokens": 1})
        assert time.perf_counter() - started < 5
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "prompt" and "--tokenize-timeout" in error["message"], error
        for _ in range(3):  # the killed worker's replacement joins; the other one serves meanwhile
            assert _completion(base) <= 5.0
        assert _health(base) <= 1.0


def test_tokenize_refuses_more_than_max_tokenize_bytes(tiny_model_dir):
    with serve_process(tiny_model_dir, "--max-tokenize-bytes", "100000") as (_, base):
        for body in ({"model": MODEL, "prompt": "y" * 100_001},
                     {"model": MODEL, "messages": [{"role": "user", "content": "y" * 100_001}]}):
            reply = HTTP.post(f"{base}/tokenize", headers=HEADERS, timeout=60, json=body)
            assert reply.status_code == 400, reply.text
            assert "--max-tokenize-bytes" in reply.json()["error"]["message"]
        reply = HTTP.post(f"{base}/tokenize", headers=HEADERS, timeout=60,
                          json={"model": MODEL, "prompt": "y" * 99_000})
        assert reply.status_code == 200 and reply.json()["count"] > 0
