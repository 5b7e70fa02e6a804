"""`kestrel bench serve` against a fake OpenAI-compatible streaming server with known timings and failures."""

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kestrel.bench.serve import arrival_offsets, level_seed, main

REPO = Path(__file__).resolve().parents[2]


@dataclass
class FakeState:
    """How the fake server behaves, and what it saw; reset before every test."""

    ttft_s: float = 0.01  # sleep before the first chunk
    itl_s: float = 0.005  # sleep between chunks
    api_key: str | None = None
    send_usage: bool = True
    tokens_per_chunk: int = 1
    fail_503: set[int] = field(default_factory=set)  # request numbers (arrival order) answered with 503
    drop: set[int] = field(default_factory=set)  # request numbers whose connection breaks mid-stream
    stream_error: set[int] = field(default_factory=set)  # request numbers that get an error event mid-stream
    no_done: set[int] = field(default_factory=set)  # request numbers whose stream ends without [DONE]
    bodies: list[dict] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


STATE = FakeState()


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def text_chunk(text: str, finish: str | None = None) -> dict:
    return {"id": "cmpl-fake", "object": "text_completion", "model": "fake-model",
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}], "usage": None}


def make_app() -> FastAPI:
    app = FastAPI()

    def unauthorized(request: Request) -> JSONResponse | None:
        if STATE.api_key and request.headers.get("authorization") != f"Bearer {STATE.api_key}":
            return JSONResponse({"error": {"message": "bad key", "type": "auth", "param": None, "code": 401}}, 401)
        return None

    @app.get("/v1/models")
    async def models(request: Request):
        return unauthorized(request) or {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/version")
    async def version():
        return {"version": "fake-0"}

    @app.post("/tokenize")
    async def tokenize(request: Request):  # one token per word
        body = await request.json()
        return {"count": len(body["prompt"].split()), "max_model_len": 4096, "tokens": []}

    @app.post("/v1/completions")
    async def completions(request: Request):
        if (denied := unauthorized(request)) is not None:
            return denied
        body = await request.json()
        number = len(STATE.bodies)
        STATE.bodies.append(body)
        STATE.arrivals.append(time.perf_counter())
        if number in STATE.fail_503:
            return JSONResponse({"error": {"message": "overloaded", "type": "busy", "param": None, "code": 503}},
                                503)
        STATE.in_flight += 1
        STATE.max_in_flight = max(STATE.max_in_flight, STATE.in_flight)
        n_chunks = -(-body["max_tokens"] // STATE.tokens_per_chunk)

        async def stream() -> AsyncIterator[str]:
            try:
                await asyncio.sleep(STATE.ttft_s)
                for i in range(n_chunks):
                    if i:
                        await asyncio.sleep(STATE.itl_s)
                    if i == 1 and number in STATE.drop:
                        raise RuntimeError("fake server breaks the connection")
                    if i == 1 and number in STATE.stream_error:
                        yield sse({"error": {"message": "engine died", "type": "internal", "code": 500}})
                        break
                    yield sse(text_chunk("ab" * STATE.tokens_per_chunk))
                # a closing chunk with empty text, as some servers send: it must not count as a token
                yield sse(text_chunk("", finish="length"))
                if STATE.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                    yield sse({"id": "cmpl-fake", "object": "text_completion", "choices": [],
                               "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"],
                                         "total_tokens": len(body["prompt"]) + body["max_tokens"]}})
                if number not in STATE.no_done:
                    yield sse("[DONE]")
            finally:
                STATE.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(make_app(), host="127.0.0.1", port=0, log_level="critical",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture(autouse=True)
def fresh_state() -> None:
    STATE.__init__()  # the app's handlers read the module-level STATE object


def bench(base_url: str, tmp_path: Path, *extra: str, prompts: int = 12, input_len: int = 16,
          output_len: int = 5) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    rc = main(["--base-url", base_url, "--num-prompts", str(prompts), "--input-len", str(input_len),
               "--output-len", str(output_len), "--result-file", str(out), "--save-requests", *extra])
    return rc, json.loads(out.read_text())


def test_fixed_concurrency_counts_and_timings(base_url, tmp_path):
    STATE.api_key = "sekrit"
    STATE.ttft_s, STATE.itl_s = ttft_s, itl_s = 0.1, 0.05
    rc, doc = bench(base_url + "/v1", tmp_path, "--concurrency", "4", "--ignore-eos", "--api-key", "sekrit")
    assert rc == 0
    assert doc["config"]["model"] == "fake-model"  # asked GET /v1/models
    assert doc["environment"]["server_version"] == {"version": "fake-0"}
    assert doc["environment"]["git_sha"] and doc["environment"]["timestamp"]
    assert doc["environment"]["git_dirty"] in (True, False, None)
    [res] = doc["results"]
    m = res["metrics"]
    assert (res["mode"], res["concurrency"]) == ("concurrency", 4)
    assert m["completed"] == 12 and m["failed"] == 0 and m["errors"] == {}
    assert m["total_input_tokens"] == 12 * 16 and m["total_output_tokens"] == 12 * 5
    assert m["short_outputs"] == 0
    assert STATE.max_in_flight == 4

    assert len(STATE.bodies) == 12
    for body in STATE.bodies:
        assert body["model"] == "fake-model" and body["max_tokens"] == 5 and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0
        assert len(body["prompt"]) == 16 and all(isinstance(t, int) and 0 <= t < 1000 for t in body["prompt"])
    assert len({tuple(b["prompt"]) for b in STATE.bodies}) == 12

    # the fake server sleeps ttft_s before the first chunk and itl_s between chunks; the bounds leave room for
    # a slow, shared machine but not for a wrong definition (TTFT to the response headers would be near 0 ms,
    # TTFT to the last chunk 300 ms; ITL or TPOT over the closing chunk or [DONE] would be near 0 ms)
    assert m["itl_ms"]["count"] == 12 * 4  # the closing empty chunk is not a token
    assert m["tpot_ms"]["count"] == 12
    assert 0.95 * ttft_s * 1e3 <= m["ttft_ms"]["median"] <= ttft_s * 1e3 + 120
    assert 0.8 * itl_s * 1e3 <= m["itl_ms"]["median"] <= itl_s * 1e3 + 60
    assert 0.8 * itl_s * 1e3 <= m["tpot_ms"]["median"] <= itl_s * 1e3 + 60
    e2e_floor = (ttft_s + 4 * itl_s) * 1e3
    assert 0.95 * e2e_floor <= m["e2e_ms"]["median"] <= e2e_floor + 200
    assert m["duration_s"] >= 3 * 0.95 * e2e_floor / 1e3  # 12 requests, 4 at a time
    assert res["client"]["cpu_utilization"] > 0 and res["client"]["loop_lag_ms"]["count"] > 0
    assert m["output_throughput"] == pytest.approx(60 / m["duration_s"])
    records = res["requests"]
    assert [r["index"] for r in records] == list(range(12))
    assert all(r["success"] and r["output_tokens"] == 5 and len(r["chunk_times_s"]) == 5 for r in records)


def test_wrong_api_key_fails_every_request(base_url, tmp_path):
    STATE.api_key = "sekrit"
    rc, doc = bench(base_url, tmp_path, "--concurrency", "2", "--model", "fake-model", "--api-key", "nope",
                    prompts=3)
    m = doc["results"][0]["metrics"]
    assert rc == 1 and m["failed"] == 3 and m["completed"] == 0
    assert [e.split(":")[0] for e in m["errors"]] == ["HTTP 401"]


def test_errors_are_counted_not_measured(base_url, tmp_path):
    STATE.fail_503 = {2, 8}
    STATE.drop = {4, 10}
    STATE.stream_error = {5}
    STATE.no_done = {11}
    rc, doc = bench(base_url, tmp_path, "--concurrency", "3")
    m = doc["results"][0]["metrics"]
    assert rc == 1
    assert m["completed"] == 6 and m["failed"] == 6
    assert m["total_output_tokens"] == 6 * 5 and m["total_input_tokens"] == 6 * 16
    assert m["itl_ms"]["count"] == 6 * 4 and m["ttft_ms"]["count"] == 6
    kinds = {e.split(":")[0]: n for e, n in m["errors"].items()}
    assert kinds == {"HTTP 503": 2, "RemoteProtocolError": 2, "error in stream": 1, "stream ended without data": 1}
    assert [r["success"] for r in doc["results"][0]["requests"]].count(False) == 6


def test_without_usage_tokens_are_counted_from_chunks(base_url, tmp_path):
    STATE.send_usage = False
    rc, doc = bench(base_url, tmp_path, "--concurrency", "4", prompts=4, output_len=6)
    m = doc["results"][0]["metrics"]
    assert rc == 0 and m["total_output_tokens"] == 4 * 6
    assert m["total_input_tokens"] == 4 * 16  # without usage, the prompt length sent


def test_multi_token_chunks_use_usage_for_tpot(base_url, tmp_path):
    STATE.tokens_per_chunk = 2
    STATE.itl_s = 0.04
    rc, doc = bench(base_url, tmp_path, "--concurrency", "4", prompts=4, output_len=6)
    m = doc["results"][0]["metrics"]
    assert rc == 0 and m["total_output_tokens"] == 4 * 6
    assert m["itl_ms"]["count"] == 4 * 2  # 3 chunks per request
    # TPOT spreads 2 chunk gaps over 5 tokens (about 16 ms); ITL is per chunk (about 40 ms)
    assert m["tpot_ms"]["median"] < 0.75 * m["itl_ms"]["median"]


def test_poisson_follows_the_seeded_schedule(base_url, tmp_path):
    rate, n, seed = 10.0, 10, 7
    rc, doc = bench(base_url, tmp_path, "--request-rate", str(rate), "--seed", str(seed), prompts=n, output_len=2)
    res = doc["results"][0]
    assert rc == 0 and res["mode"] == "request_rate" and res["request_rate"] == rate
    assert len(STATE.bodies) == n and res["metrics"]["completed"] == n
    expected = arrival_offsets(n, rate, level_seed("arrivals", seed, 0))
    assert expected[-1] > 0.5  # a schedule worth checking, not a burst
    # never early; late only by what a busy shared machine may add
    sent = [r["start_s"] for r in res["requests"]]
    for want, got in zip(expected, sent):
        assert want - 0.001 <= got <= want + 0.3
    seen_span = max(STATE.arrivals) - min(STATE.arrivals)
    assert 0.8 * expected[-1] <= seen_span <= expected[-1] + 0.3


def test_rate_inf_respects_max_concurrency(base_url, tmp_path):
    rc, doc = bench(base_url, tmp_path, "--request-rate", "inf", "--max-concurrency", "2", prompts=6)
    res = doc["results"][0]
    assert rc == 0 and res["request_rate"] == "inf" and res["max_concurrency"] == 2
    assert res["metrics"]["completed"] == 6 and STATE.max_in_flight == 2


def test_sweep_writes_one_result_per_level(base_url, tmp_path, capsys):
    rc, doc = bench(base_url, tmp_path, "--concurrency", "1,3", "--warmup-requests", "2", prompts=3)
    assert rc == 0 and doc["warmup_failed"] == 0
    assert [r["concurrency"] for r in doc["results"]] == [1, 3]
    assert all(r["metrics"]["completed"] == 3 for r in doc["results"])
    assert len(STATE.bodies) == 2 + 3 + 3
    assert len({tuple(b["prompt"]) for b in STATE.bodies}) == 8  # no prompt repeats across warm-up and levels
    out = capsys.readouterr().out
    assert "concurrency 1" in out and "concurrency 3" in out and "TTFT p99" in out
    png = next(tmp_path.glob("*.png"))  # the plot beside the JSON
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    # no --model: the model lookup fails, so nothing runs (through `python -m`, as a user would call it)
    proc = subprocess.run([sys.executable, "-m", "kestrel.bench.serve", "--base-url", url, "--concurrency", "2",
                           "--num-prompts", "2", "--input-len", "4", "--output-len", "2"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "cannot query" in proc.stderr
    # with --model: every request fails with a connection error and is counted
    rc, doc = bench(url, tmp_path, "--concurrency", "2", "--model", "m", prompts=3)
    m = doc["results"][0]["metrics"]
    assert rc == 1 and m["failed"] == 3 and m["completed"] == 0
    assert list(m["errors"]) == [next(iter(m["errors"]))] and "ConnectError" in next(iter(m["errors"]))


def test_vllm_flags_sharegpt_and_flat_result_keys(base_url, tmp_path):
    words = " ".join
    conversations = [{"conversations": [{"from": "human", "value": words(["ask"] * (4 + i))},
                                        {"from": "gpt", "value": words(["answer"] * (4 + i))}]} for i in range(4)]
    conversations.append({"conversations": [{"from": "human", "value": "too short"},
                                            {"from": "gpt", "value": words(["x"] * 9)}]})  # filtered: < 4 tokens
    conversations.append({"conversations": [{"from": "human", "value": "no reply"}]})
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    rc = main(["--base-url", base_url, "--backend", "vllm", "--dataset-name", "sharegpt", "--dataset-path",
               str(dataset), "--num-prompts", "3", "--save-result", "--result-dir", str(tmp_path / "out"),
               "--result-filename", "r.json", "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles",
               "50,99.9", "--goodput", "ttft:60000", "tpot:60000"])
    assert rc == 0
    doc = json.loads((tmp_path / "out" / "r.json").read_text())
    assert len(STATE.bodies) == 3
    for body in STATE.bodies:  # text prompts from the file, each with its reply's length as max_tokens
        assert body["prompt"].startswith("ask") and body["max_tokens"] == len(body["prompt"].split())
    assert doc["completed"] == 3 and doc["backend"] == "vllm" and doc["model_id"] == "fake-model"
    for key in ("mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99.9_ttft_ms", "mean_tpot_ms",
                "p99.9_e2el_ms", "request_throughput", "output_throughput", "total_token_throughput",
                "input_lens", "output_lens", "duration"):
        assert key in doc, key
    assert "mean_itl_ms" not in doc  # itl was not asked for
    assert doc["request_goodput"] == pytest.approx(3 / doc["duration"])
    assert doc["results"][0]["p99.9_ttft_ms"] == doc["p99.9_ttft_ms"]


def test_random_dataset_takes_vllms_length_flags(base_url, tmp_path):
    out = tmp_path / "r.json"
    rc = main(["--base-url", base_url, "--num-prompts", "4", "--random-input-len", "7", "--random-output-len", "3",
               "--result-file", str(out), "--burstiness", "0.5", "--request-rate", "50"])
    assert rc == 0 and all(len(b["prompt"]) == 7 and b["max_tokens"] == 3 for b in STATE.bodies)
    assert json.loads(out.read_text())["config"]["burstiness"] == 0.5


def test_burstiness_keeps_the_mean_rate():
    gaps = [b - a for a, b in zip(*(lambda o: (o, o[1:]))(arrival_offsets(4001, 20.0, "s", burstiness=0.25)))]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.1)
    steady = [b - a for a, b in zip(*(lambda o: (o, o[1:]))(arrival_offsets(4001, 20.0, "s", burstiness=8.0)))]
    spread = lambda xs: (sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)) ** 0.5  # noqa: E731
    assert spread(steady) < spread(gaps)
