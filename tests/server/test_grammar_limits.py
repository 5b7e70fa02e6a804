"""Grammar compilation never blocks anyone (issue 25, part 1), on kestrel-tiny with one compile worker process:
the table's three attacks (a 100,000-string enum, a schema of 5,000 required properties, 50,000 choices) are 400s
naming the limit and its flag while /health and a one-token completion stay fast beside them; a grammar under the
limits that compiles past --grammar-compile-timeout is a 400 naming the flag, its worker killed and replaced, and
it never enters the engine meanwhile; a client that goes away stops its compile; a repeated grammar comes from the
cache; and the grammars compiled this way still constrain the answers (jsonschema)."""

import itertools
import json
import threading
import time

import httpx
import jsonschema
import pytest
from conftest import API_KEY, LiveServer
from http_client import HTTP

from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.server import build_app

# Latency bounds: run alone, not beside other tests (`make test` runs the `serial` ones after the rest).
pytestmark = pytest.mark.serial

MODEL = "kestrel-tiny"
COMPILE_TIMEOUT_S = 2.0
# Under every limit (40 bytes), yet its pattern's repetition takes xgrammar ~20 s to compile (quadratic in the
# count) against kestrel-tiny's 8k vocabulary: only the deadline stops it.
SLOW_SCHEMA = {"type": "string", "pattern": "[a-z]{1,12000}"}
LANGUAGE = {
    "type": "object",
    "properties": {"language": {"enum": ["python", "c", "rust"]}, "typed": {"type": "boolean"}},
    "required": ["language", "typed"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server():
    from kestrel.tiny import default_model_path

    engine = AsyncEngine.from_args(str(default_model_path()), max_model_len=256, max_num_seqs=16, device="cpu",
                                   async_scheduling=True).start()
    app = build_app(engine, MODEL, api_key=API_KEY, grammar_compile_workers=1,
                    grammar_compile_timeout=COMPILE_TIMEOUT_S)
    live = LiveServer(app, engine, model=MODEL)
    yield live
    live.stop()
    app.state.grammar_pool.close()


def post(server, path, body, timeout=60.0):
    return HTTP.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, headers=server.headers,
                     timeout=timeout)


def completion(**fields):
    return {"prompt": "The answer is", "max_tokens": 1, **fields}


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]


def error_of(reply: httpx.Response) -> dict:
    assert reply.status_code == 400, reply.text[:300]
    return reply.json()["error"]


ATTACKS = {
    "enum of 100,000 strings": ("/v1/completions", completion(
        max_tokens=8, structured_outputs={"json": {"type": "string", "enum": [f"v{i:06d}" for i in range(100_000)]}}),
        "structured_outputs.json", "--max-grammar-choices"),
    "5,000 required properties": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": {
            "type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(5000)},
            "required": [f"field_{i}" for i in range(5000)]}}}},
        "response_format", "--max-schema-properties"),
    "50,000 choices": ("/v1/completions", completion(
        max_tokens=8, structured_outputs={"choice": [f"option {i}" for i in range(50_000)]}),
        "structured_outputs.choice", "--max-grammar-choices"),
}


def measure_beside_the_attacks(server, bodies: dict[str, bytes], seconds: float = 3.0) -> tuple[list, list]:
    """/health and one-token completion latencies while one client sends the attacks, one at a time, again and
    again; every attack's reply is checked."""
    results: dict[str, list[tuple[float, httpx.Response]]] = {name: [] for name in ATTACKS}
    stop = threading.Event()

    def attack() -> None:
        with httpx.Client(headers={**server.headers, "Content-Type": "application/json"}, timeout=30) as client:
            for name in itertools.cycle(ATTACKS):
                if stop.is_set() and all(results.values()):
                    return
                started = time.monotonic()
                reply = client.post(f"{server.base_url}{ATTACKS[name][0]}", content=bodies[name])
                results[name].append((time.monotonic() - started, reply))
                stop.wait(0.1)

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    health, completions = [], []
    try:
        with httpx.Client(headers=server.headers, timeout=30) as client:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                started = time.monotonic()
                assert client.get(f"{server.base_url}/health").status_code == 200
                health.append(time.monotonic() - started)
                if len(health) % 4 == 0:
                    started = time.monotonic()
                    reply = client.post(f"{server.base_url}/v1/completions", json={"model": MODEL, **completion()})
                    assert reply.status_code == 200, reply.text
                    completions.append(time.monotonic() - started)
                time.sleep(0.02)
    finally:
        stop.set()
        attacker.join(120)
    for name, (_, _, param, flag) in ATTACKS.items():
        assert results[name], name
        for took, reply in results[name]:
            error = error_of(reply)
            assert error["param"] == param and flag in error["message"], (name, error)
            assert took < 5, (name, took)  # the old server answered after minutes, or never
    return health, completions


def test_the_table_attacks_fail_fast_while_health_and_completions_stay_fast(server):
    """The issue's targets beside the attacks: /health p99 <= 200 ms, a one-token completion's p99 <= 1 s. A
    second measurement is allowed, so that one stall of a loaded machine does not fail the test; the old server
    failed every measurement (its attacks held the engine for minutes)."""
    bodies = {name: json.dumps({"model": MODEL, **body}).encode() for name, (_, body, _, _) in ATTACKS.items()}
    assert post(server, "/v1/completions", completion()).status_code == 200  # the engine's first step is slower
    for _ in range(2):
        health, completions = measure_beside_the_attacks(server, bodies)
        if p99(health) <= 0.2 and p99(completions) <= 1.0:
            return
    pytest.fail(f"beside the attacks: /health p99 {p99(health):.3f} s (slowest {sorted(health)[-3:]}), one-token "
                f"completion p99 {p99(completions):.3f} s (slowest {sorted(completions)[-3:]})")


def test_compiled_grammars_still_constrain_the_answers(server):
    reply = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "A language."}], "max_tokens": 60, "temperature": 0.0,
        "structured_outputs": {"json": LANGUAGE}})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), LANGUAGE)
    for seed in range(3):
        reply = post(server, "/v1/completions", completion(
            max_tokens=4, seed=seed, temperature=1.0, structured_outputs={"choice": ["yes", "no", "maybe"]}))
        assert reply.json()["choices"][0]["text"] in ("yes", "no", "maybe")


def test_a_repeated_grammar_comes_from_the_cache(server):
    cache = server.app.state.grammar_pool.cache
    body = completion(structured_outputs={"regex": "cached-[0-9]{2}"})
    assert post(server, "/v1/completions", body).status_code == 200
    hits, misses = cache.hits, cache.misses
    for _ in range(3):
        assert post(server, "/v1/completions", body).status_code == 200
    assert (cache.hits, cache.misses) == (hits + 3, misses)


def test_an_invalid_grammar_is_a_400_from_the_worker(server):
    error = error_of(post(server, "/v1/completions", completion(structured_outputs={"grammar": "root ::= ("})))
    assert error["param"] == "structured_outputs.grammar" and "could not be compiled" in error["message"]
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"x": {"enum": list(range(5000))}}}}}
    error = error_of(post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": "required"}))
    assert error["param"] == "tools" and "--max-grammar-choices" in error["message"]


_ATTEMPTS = itertools.count()


def wait_for_a_compile_worker(server, timeout_s: float = 60.0) -> None:
    """A killed worker's replacement imports xgrammar first (seconds): wait until a new grammar compiles again."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = post(server, "/v1/completions", completion(structured_outputs={"regex": f"ready{next(_ATTEMPTS)}"}))
        if reply.status_code == 200:
            return
        assert time.monotonic() < deadline, reply.text


def test_a_grammar_past_the_compile_deadline_is_a_400_and_its_worker_is_replaced(server):
    pool = server.app.state.grammar_pool
    replaced = pool.replaced
    reply: list[httpx.Response] = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: reply.append(post(server, "/v1/completions", completion(
        structured_outputs={"json": SLOW_SCHEMA}), timeout=30)))
    thread.start()
    health = []
    while thread.is_alive():
        probe = time.monotonic()
        assert HTTP.get(f"{server.base_url}/health", timeout=10).status_code == 200
        health.append(time.monotonic() - probe)
        # Waiting for its grammar, the request is not in the engine: no batch slot, no KV block.
        metrics = server.metrics()
        assert metrics["kestrel:num_requests_running"] + metrics["kestrel:num_requests_waiting"] == 0
        assert metrics["kestrel:kv_cache_usage_perc"] == 0
        time.sleep(0.1)
    elapsed = time.monotonic() - started
    error = error_of(reply[0])
    assert error["param"] == "structured_outputs.json" and "--grammar-compile-timeout" in error["message"]
    assert COMPILE_TIMEOUT_S <= elapsed < COMPILE_TIMEOUT_S + 3
    assert pool.replaced == replaced + 1
    assert max(health) < 1.0, sorted(health)[-5:]  # the server stays responsive throughout
    wait_for_a_compile_worker(server)


def test_a_client_that_goes_away_stops_its_compile(server):
    pool = server.app.state.grammar_pool
    wait_for_a_compile_worker(server)
    replaced = pool.replaced
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        post(server, "/v1/completions", completion(structured_outputs={"json": SLOW_SCHEMA}), timeout=0.5)
    while pool.replaced == replaced and time.monotonic() - started < COMPILE_TIMEOUT_S:
        time.sleep(0.02)
    # Killed when the client left, not at the deadline.
    assert pool.replaced == replaced + 1 and time.monotonic() - started < COMPILE_TIMEOUT_S
    wait_for_a_compile_worker(server)
