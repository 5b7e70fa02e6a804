"""What an unauthenticated client can reach and learn (the API key covers /metrics, the Bearer scheme in any case,
/health without internals), the drain's 503 for new connections, and request_success counted per request."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from conftest import API_KEY, MODEL, LiveServer, scripted_engine
from http_client import HTTP

from kestrel.entrypoints.http_server import DrainingServer
from kestrel.entrypoints.server import build_app
from kestrel.executor.base import WorkerError

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def scripted_server(model_dir: str, *, drain_timeout_s: float | None = None, uvicorn_root_path: str = "",
                    **settings) -> LiveServer:
    engine, _ = scripted_engine(model_dir, step_delay_s=0.02)
    app = build_app(engine, MODEL, api_key=API_KEY, **settings)
    if drain_timeout_s is None:
        return LiveServer(app, engine, root_path=uvicorn_root_path)
    return LiveServer(app, engine, server_factory=lambda config: DrainingServer(config, engine, drain_timeout_s))


@pytest.fixture
def servers(tiny_model_dir):
    started: list[LiveServer] = []

    def start(**kwargs) -> LiveServer:
        started.append(scripted_server(tiny_model_dir, **kwargs))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    server = scripted_server(tiny_model_dir)
    yield server
    server.stop()


# ----- the API key ---------------------------------------------------------------------------------

def test_metrics_need_the_key_unless_public(servers):
    guarded = servers()
    anonymous = HTTP.get(f"{guarded.base_url}/metrics", timeout=10)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    assert "tiny" not in anonymous.text  # not even the model's name
    assert HTTP.get(f"{guarded.base_url}/metrics", headers=HEADERS, timeout=10).status_code == 200
    public = servers(public_metrics=True)
    assert "vllm:num_requests_running" in HTTP.get(f"{public.base_url}/metrics", timeout=10).text
    for path in ("/health", "/ping", "/version", "/"):  # open either way
        assert HTTP.get(f"{guarded.base_url}{path}", timeout=10).status_code == 200, path
    assert HTTP.post(f"{guarded.base_url}/ping", timeout=10).status_code == 200  # vLLM's probe takes POST too


@pytest.mark.parametrize("authorization", [f"Bearer {API_KEY}", f"bearer {API_KEY}", f"BEARER {API_KEY}",
                                           f"bEaReR   {API_KEY}"])
def test_the_bearer_scheme_is_case_insensitive(guarded, authorization):
    reply = HTTP.get(f"{guarded.base_url}/v1/models", headers={"Authorization": authorization}, timeout=10)
    assert reply.status_code == 200 and reply.json()["data"][0]["id"] == MODEL


@pytest.mark.parametrize("authorization", [None, "", "Bearer", f"Basic {API_KEY}", f"Bearer{API_KEY}",
                                           f"Bearer {API_KEY.upper()}", f"Bearer {API_KEY}x", f"Bearer x{API_KEY}",
                                           API_KEY])
def test_anything_but_the_key_is_401(guarded, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    for path in ("/v1/models", "/metrics"):
        reply = HTTP.get(f"{guarded.base_url}{path}", headers=headers, timeout=10)
        assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer", (path, authorization)


def test_every_route_but_the_probes_and_the_playground_needs_the_key(guarded):
    """The key guards every route the app has (vLLM's /v2/rerank, /pooling, /score, /rerank, /classify, ... as
    well as /v1/), whatever its method; only the probes and the playground's static page are open."""
    from kestrel.entrypoints.server import OPEN_PATHS

    routes = [(route.path, sorted(route.methods or {"GET"})[0]) for route in guarded.app.routes
              if hasattr(route, "path") and "{" not in route.path]
    assert any(path == "/v2/rerank" for path, _ in routes)
    for path, method in routes:
        reply = HTTP.request(method, f"{guarded.base_url}{path}", json={}, timeout=10)
        if path in OPEN_PATHS or path.startswith("/static/"):
            assert reply.status_code != 401, path
        else:
            assert reply.status_code == 401, (path, method, reply.status_code)


def test_the_key_guards_the_api_under_a_root_path(servers):
    # Behind a proxy that strips the prefix (--root-path /api), uvicorn puts it back into the request's path, and
    # the routes strip it again.
    server = servers(root_path="/api", uvicorn_root_path="/api")
    for path in ("/v1/models", "/metrics"):
        assert HTTP.get(f"{server.base_url}{path}", timeout=10).status_code == 401, path
        reply = HTTP.get(f"{server.base_url}{path}", headers=HEADERS, timeout=10)
        assert reply.status_code == 200, path


# ----- what /health tells anyone --------------------------------------------------------------------

def test_health_names_no_internals_of_a_dead_worker(servers):
    server = servers()
    runner = server.engine.core.runner
    internals = "distributed executor failed: worker rank 1 (pid 48213) exited with code -9 (/dev/shm/kestrel-7)"
    runner.healthy, runner.error = False, WorkerError(internals)  # what a distributed executor reports
    reply = HTTP.get(f"{server.base_url}/health", timeout=10)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "engine_dead"
    assert "48213" not in reply.text and "pid" not in reply.text and "/dev/shm" not in reply.text, reply.text


def test_a_crashed_engine_keeps_its_error_in_the_log(servers, caplog):
    server = servers()
    runner = server.engine.core.runner
    runner.fail_at_step = 1
    runner.script = "x"
    with caplog.at_level("ERROR", logger="kestrel.engine"):
        failed = HTTP.post(f"{server.base_url}/v1/completions", headers=HEADERS, timeout=10,
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        deadline = time.monotonic() + 5
        while server.engine.is_healthy and time.monotonic() < deadline:
            time.sleep(0.01)
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_dead"
    health = HTTP.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    for reply in (failed, health):
        assert "scripted model failure" not in reply.text and "RuntimeError" not in reply.text, reply.text
    assert "scripted model failure" in caplog.text  # the details stay on the server's side


# ----- the drain --------------------------------------------------------------------------------------

class Stream:
    """A long streamed completion read in a thread: its data lines."""

    def __init__(self, base_url: str) -> None:
        self.events: list[str] = []
        self.started = threading.Event()
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 480, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._read, args=(base_url, body), daemon=True)
        self._thread.start()

    def _read(self, base_url: str, body: dict) -> None:
        with HTTP.stream("POST", f"{base_url}/v1/completions", json=body, headers=HEADERS, timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.started.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream never ended"


@pytest.mark.serial  # a time bound: run alone, after the rest (`make test`)
def test_new_connections_during_the_drain_get_503_then_the_server_stops(servers):
    server = servers(drain_timeout_s=1.5)
    stream = Stream(server.base_url)
    assert stream.started.wait(10)
    server._server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
    signalled = time.monotonic()
    for method, path, headers in (("POST", "/v1/completions", HEADERS), ("GET", "/v1/models", HEADERS),
                                  ("GET", "/health", {}), ("POST", "/ping", {}), ("GET", "/metrics", HEADERS),
                                  ("GET", "/v1/models", {})):
        reply = HTTP.request(method, f"{server.base_url}{path}", headers=headers, timeout=5,
                             json={"model": MODEL, "prompt": "x"} if method == "POST" else None)
        error = reply.json()["error"]
        assert reply.status_code == 503 and error["code"] == "server_shutting_down", (path, reply.text)
        assert set(error) == {"message", "type", "param", "code"}
    stream.join(10)
    assert stream.events[-1] == "[DONE]" and "server_shutting_down" in stream.events[-2]
    server._thread.join(5)
    assert not server._thread.is_alive() and time.monotonic() - signalled < 1.5 + 2.0


def test_an_idle_server_stops_at_once_and_a_second_signal_ends_the_drain(servers):
    idle = servers(drain_timeout_s=30)
    idle._server.handle_exit(signal.SIGTERM, None)
    idle._thread.join(3)
    assert not idle._thread.is_alive()  # nothing to wait for
    busy = servers(drain_timeout_s=30)
    stream = Stream(busy.base_url)
    assert stream.started.wait(10)
    busy._server.handle_exit(signal.SIGTERM, None)
    time.sleep(0.2)
    assert stream._thread.is_alive()  # the drain lets it run ...
    busy._server.handle_exit(signal.SIGTERM, None)  # ... until a second signal
    stream.join(3)
    assert stream.events[-1] == "[DONE]" and "server_shutting_down" in stream.events[-2]
    busy._thread.join(3)
    assert not busy._thread.is_alive()


# ----- request_success ---------------------------------------------------------------------------------

def success_and_e2e(server: LiveServer) -> tuple[float, float]:
    samples = server.metrics()
    # The counter's series per finish reason, summed (each exists from the start, at 0).
    return (samples.get("kestrel:request_success_total", 0.0),
            samples.get("kestrel:e2e_request_latency_seconds_count", 0.0))


@pytest.mark.parametrize("stream", [False, True])
def test_request_success_counts_requests_as_e2e_latency_does(openai_server, stream):
    client = openai_server.client()
    success, e2e = success_and_e2e(openai_server)
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, n=3, temperature=1.0,
                                      stream=stream)
    if stream:
        assert len({chunk.choices[0].index for chunk in reply if chunk.choices}) == 3
    else:
        assert len(reply.choices) == 3
    client.completions.create(model=MODEL, prompt=["a b", "c d"], max_tokens=2, n=2)  # two engine requests
    after_success, after_e2e = success_and_e2e(openai_server)
    assert after_e2e - e2e == 3 and after_success - success == 3


def test_a_request_whose_second_prompt_is_refused_ends_its_first(servers):
    """A completion of two prompts is two engine requests: when the engine refuses the second (the drain began
    between the two submits), the first is aborted with it, not left to run out its 500 tokens."""
    server = servers()
    engine = server.engine
    submitted: list[str] = []
    submit = engine.submit

    def submit_then_drain(request_id, *args, **kwargs):
        stream = submit(request_id, *args, **kwargs)
        submitted.append(request_id)
        engine.begin_drain()
        return stream

    engine.submit = submit_then_drain
    reply = HTTP.post(f"{server.base_url}/v1/completions", headers=HEADERS, timeout=10,
                      json={"model": MODEL, "prompt": ["def a", "def b"], "max_tokens": 500, "ignore_eos": True})
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "server_shutting_down"
    assert len(submitted) == 1
    deadline = time.monotonic() + 3  # 500 scripted steps of 20 ms would take 10 s
    while engine.core.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.core.has_unfinished_requests()
