"""Graceful shutdown (SIGTERM drains, then ends every unfinished request with a well-formed answer) and the
header / body read timeouts that stop slow clients from holding connections."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from conftest import API_KEY, MODEL, LiveServer, scripted_engine, serve_process
from http_client import HTTP

from kestrel.entrypoints.http_server import DrainingServer, protocol_with_header_timeout
from kestrel.entrypoints.server import build_app

# Latency bounds: run alone, not beside other tests (`make test` runs the `serial` ones after the rest).
pytestmark = pytest.mark.serial

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def completion(max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


class Outcome:
    """One request run in a thread: the status and either the JSON body or the stream's data lines."""

    def __init__(self, base_url: str, body: dict) -> None:
        self.status: int | None = None
        self.json: dict | None = None
        self.events: list[str] = []
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base_url, body), daemon=True)
        self._thread.start()

    def _run(self, base_url: str, body: dict) -> None:
        with httpx.Client(timeout=60) as client:
            if body["stream"]:
                with client.stream("POST", f"{base_url}/v1/completions", json=body, headers=HEADERS) as response:
                    self.status = response.status_code
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            self.events.append(line[6:])
                            self.started.set()
            else:
                self.started.set()
                response = client.post(f"{base_url}/v1/completions", json=body, headers=HEADERS)
                self.status, self.json = response.status_code, response.json()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "a request never ended"


def assert_ended_by_shutdown(outcome: Outcome) -> None:
    if outcome.events:  # streamed: the chunks, then one error event, then [DONE]
        assert outcome.status == 200 and outcome.events[-1] == "[DONE]"
        error = json.loads(outcome.events[-2])["error"]
        assert error["code"] == "server_shutting_down" and set(error) == {"message", "type", "param", "code"}
        assert all("choices" in json.loads(e) for e in outcome.events[:-2])
    else:
        assert outcome.status == 503 and outcome.json["error"]["code"] == "server_shutting_down"


@pytest.fixture
def draining_server(tiny_model_dir):
    engine, _ = scripted_engine(tiny_model_dir, step_delay_s=0.02)
    server = LiveServer(build_app(engine, MODEL, api_key=API_KEY), engine,
                        server_factory=lambda config: DrainingServer(config, engine, drain_timeout_s=1.0))
    yield server
    server.stop()


def test_sigterm_refuses_new_work_lets_short_requests_finish_and_ends_the_rest(draining_server):
    base = draining_server.base_url
    long_ones = [Outcome(base, completion(480, stream=s)) for s in (True, True, False, False)]
    short = Outcome(base, completion(30, stream=False))  # 0.6 s of steps: ends within the drain
    for o in long_ones + [short]:
        assert o.started.wait(10)
    deadline = time.monotonic() + 10
    while draining_server.engine.num_unfinished < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    draining_server._server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
    assert draining_server.engine.draining and not draining_server.engine.is_healthy
    short.join(10)
    assert short.status == 200 and short.json["usage"]["completion_tokens"] == 30
    for outcome in long_ones:
        outcome.join(15)
        assert_ended_by_shutdown(outcome)
    assert draining_server.engine.num_unfinished == 0


def test_a_draining_server_refuses_new_requests_with_503(start_scripted_server):
    server, _ = start_scripted_server()
    server.engine.begin_drain()
    refused = HTTP.post(f"{server.base_url}/v1/completions", json=completion(5, False), headers=HEADERS, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    streamed = HTTP.post(f"{server.base_url}/v1/completions", json=completion(5, True), headers=HEADERS, timeout=10)
    assert streamed.status_code == 503  # refused before the stream starts
    health = HTTP.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["error"]["code"] == "server_shutting_down"


def test_kestrel_serve_drains_on_sigterm_answers_503_meanwhile_and_exits_in_time(tiny_model_dir):
    drain_s = 2.0
    # 8 streams fill the batch and 88 more requests wait: all 96 would need 12 x 500 decode steps, far more than the
    # drain allows on any machine (kestrel-tiny's batch-8 step can take ~1 ms on a CPU), so some requests must be
    # ended by the shutdown, whatever the machine's speed.
    with serve_process(tiny_model_dir, "--max-model-len", "512", "--max-num-seqs", "8", "--shutdown-timeout",
                       str(drain_s)) as (server, base):
        streams = [Outcome(base, completion(500, stream=True)) for _ in range(8)]
        plain = [Outcome(base, completion(500, stream=False)) for _ in range(88)]
        for o in streams:
            assert o.started.wait(60)
        server.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # The listener stays open during the drain: new connections are answered, 503, not refused.
        while (health := HTTP.get(f"{base}/health", timeout=5)).status_code == 200:
            assert time.monotonic() - signalled < drain_s, "/health never turned 503"
            time.sleep(0.02)
        assert health.status_code == 503 and health.json()["error"]["code"] == "server_shutting_down"
        refused = HTTP.post(f"{base}/v1/completions", json=completion(5, False), headers=HEADERS, timeout=5)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert refused.headers["connection"] == "close"
        assert time.monotonic() - signalled < drain_s  # answered during the drain, not after it
        ended = 0
        for outcome in streams + plain:
            outcome.join(30)
            if outcome.json is not None and outcome.status == 200:
                assert outcome.json["usage"]["completion_tokens"] == 500  # finished within the drain
            elif outcome.events and outcome.events[-1] == "[DONE]" and '"error"' not in outcome.events[-2]:
                assert json.loads(outcome.events[-2])["choices"][0]["finish_reason"] == "length"
            else:
                assert_ended_by_shutdown(outcome)
                ended += 1
        assert ended > 0  # the drain timeout came before 12 rounds of 500 tokens
        assert server.wait(30) == 0
        assert time.monotonic() - signalled < drain_s + 2.0  # the documented bound: --shutdown-timeout + 2 s


def test_a_client_trickling_its_headers_is_disconnected(tiny_model_dir):
    engine, _ = scripted_engine(tiny_model_dir)
    server = LiveServer(build_app(engine, MODEL, api_key=API_KEY), engine, http=protocol_with_header_timeout(1.0))
    try:
        sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(10)]
        request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        closed: set[int] = set()
        started = time.monotonic()
        for i in range(len(request)):
            if len(closed) == len(sockets) or time.monotonic() - started > 8:
                break
            for k, sock in enumerate(sockets):
                if k not in closed:
                    try:
                        sock.sendall(request[i:i + 1])
                    except OSError:
                        closed.add(k)
            time.sleep(0.2)
            for k, sock in enumerate(sockets):
                sock.setblocking(False)
                try:
                    if sock.recv(1) == b"":
                        closed.add(k)
                except BlockingIOError:
                    pass
                except OSError:
                    closed.add(k)
        assert len(closed) == len(sockets) and time.monotonic() - started < 4
        # A normal client is not affected.
        assert HTTP.get(f"{server.base_url}/health", timeout=5).status_code == 200
    finally:
        for sock in sockets:
            sock.close()
        server.stop()


def test_a_body_that_does_not_arrive_in_time_is_a_408(tiny_model_dir):
    engine, _ = scripted_engine(tiny_model_dir)
    server = LiveServer(build_app(engine, MODEL, api_key=API_KEY, body_read_timeout=0.5), engine)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                         + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
            sock.settimeout(5)
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        assert json.loads(body)["error"]["code"] == "body_timeout"
    finally:
        server.stop()
