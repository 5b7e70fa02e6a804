"""`kestrel bench soak`'s summary says why a request was lost, and the bench client never reuses a connection the
server may be closing for idleness (the keep-alive race that once lost a soak request)."""

from __future__ import annotations

import asyncio

import uvicorn

from kestrel.bench import serve, soak
from kestrel.entrypoints import http_server
from kestrel.entrypoints.server_config import ServerConfig


def _record(index: int, status: int | None, error: str | None, done: bool) -> serve.RequestRecord:
    record = serve.RequestRecord(index=index, start=0.0, prompt_tokens=4, max_tokens=4, status=status, error=error)
    record.chunk_times = [0.1]
    record.end = 0.2 if done else None
    return record


def test_the_summary_and_the_verdict_name_the_errors_of_lost_requests():
    phase = soak.Phase(records=[_record(0, 200, None, True),
                                _record(1, None, "ReadError: ", False),
                                _record(2, None, "ReadError: ", False),
                                _record(3, 200, "stream ended without data: [DONE]", False),
                                _record(4, 400, "HTTP 400: bad", False)],
                       attacks=[{"name": "enum_100k", "status": None, "seconds": 1.0, "expected": False,
                                 "error": "RemoteProtocolError: Server disconnected"}])
    summary = phase.summary()
    assert summary["lost"] == 4
    assert summary["lost_errors"] == {"status None: ReadError: ": 2,
                                      "status 200: stream ended without data: [DONE]": 1,
                                      "attack enum_100k: RemoteProtocolError: Server disconnected": 1}
    assert summary["other_failures"] == {"HTTP 400: bad": 1}
    passed, problems, _ = soak.verdict({"attack": summary}, 2.0)
    assert not passed
    lost = next(p for p in problems if " lost" in p)
    assert lost.startswith("attack: 4 lost (") and "status None: ReadError: " in lost


def test_the_bench_client_lets_idle_connections_go_before_the_server_closes_them():
    # uvicorn's default idle timeout (vLLM's too) is 5 s; kestrel's is longer. The client must expire its idle
    # connections first, with a margin for the client's own lag between taking a connection and sending on it.
    default_server_idle = uvicorn.Config(app=None).timeout_keep_alive
    assert min(default_server_idle, ServerConfig().keep_alive_timeout) >= serve.KEEPALIVE_EXPIRY_S + 2.0

    async def expiry() -> float | None:
        async with serve.make_client(4, 10.0) as client:
            return client._transport._pool._keepalive_expiry  # type: ignore[attr-defined]

    assert asyncio.run(expiry()) == serve.KEEPALIVE_EXPIRY_S


def test_kestrel_serve_gives_uvicorn_its_keep_alive_timeout(monkeypatch):
    seen = {}

    def run(self: http_server.DrainingServer) -> None:
        seen["timeout_keep_alive"] = self.config.timeout_keep_alive

    monkeypatch.setattr(http_server.DrainingServer, "run", run)
    http_server.serve(object(), object(), ServerConfig(keep_alive_timeout=42.0))  # type: ignore[arg-type]
    assert seen == {"timeout_keep_alive": 42.0}
