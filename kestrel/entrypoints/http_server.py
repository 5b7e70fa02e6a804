"""The HTTP transport under the app: uvicorn's h11 protocol with a header read timeout, and a server that drains
before it stops.

Header timeout: a connection whose request line and headers are not complete `header_timeout_s` after their
first byte (or after the connection opened) is closed, so clients trickling bytes cannot hold connections. The
body has its own timeout in the app (`BodyLimitMiddleware`), and idle keep-alive connections uvicorn's, set to
`keep_alive_timeout`: longer than clients keep idle connections (uvicorn's default, 5 s, is httpx's and the OpenAI
SDK's expiry too, and a request sent on a connection as the server closed it for idleness was reset unanswered).

Drain: on SIGTERM or SIGINT the engine refuses new requests at once, and the server keeps listening: every new
request is answered 503 `server_shutting_down` (/health too), so that load balancers see the drain instead of
refused connections. The server stops when the unfinished requests are done, or `drain_timeout_s` after the
signal, when the unfinished ones are aborted: each stream ends with an error event and `[DONE]`, each
non-streaming request with a 503 body. A second signal ends the drain at once.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.server_config import ServerConfig

logger = logging.getLogger("kestrel.server")

# After the drain: time for the last error events and 503 bodies to reach the clients before uvicorn cancels them
# (they are written at once; the margin is for slow readers, and it counts against the exit within the timeout).
_FLUSH_MARGIN_S = 1.0


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout_s: float = 15.0

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._header_timer: Any = None
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._awaiting_headers():
            self._arm_header_timer()
        super().data_received(data)
        if not self._awaiting_headers():
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self._awaiting_headers() and not self.transport.is_closing():
            logger.info("closed a connection whose request headers took longer than %.0f s", self.header_timeout_s)
            self.transport.close()


def protocol_with_header_timeout(seconds: float) -> type[HeaderTimeoutProtocol]:
    """uvicorn builds protocols from a class: one class per timeout value."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": seconds})


class DrainingServer(uvicorn.Server):
    """uvicorn, but its first SIGTERM / SIGINT starts the engine's drain instead of closing the listening sockets;
    the server stops once the drain is over."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        # A signal handler: it only sets flags; on_tick, on the event loop, ends the drain.
        if self._drain_deadline is None:
            self.engine.begin_drain()
            self._drain_deadline = time.monotonic() + self.drain_timeout_s
            logger.warning("shutting down: new requests get 503; %d unfinished get up to %g s to finish",
                           self.engine.num_unfinished, self.drain_timeout_s)
        else:
            self._drain_deadline = time.monotonic()
            logger.warning("second signal: ending the drain now")

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None and not self.should_exit:
            # Done when no engine request is unfinished and no HTTP request is being served (one may still be
            # tokenizing: it is answered 503 when it reaches the engine).
            if self.engine.num_unfinished == 0 and not self.server_state.tasks:
                logger.info("drain done: every request finished")
                self.should_exit = True
            elif time.monotonic() >= self._drain_deadline:
                self._end_unfinished()
                self.should_exit = True
        return await super().on_tick(counter)

    def _end_unfinished(self) -> None:
        ended = self.engine.end_unfinished(f"the server shut down before this request finished (drain timeout "
                                           f"{self.drain_timeout_s:g} s)")
        if ended:
            logger.warning("drain timeout: ended %d unfinished requests", ended)


def serve(app: Any, engine: AsyncEngine, config: ServerConfig) -> None:
    drain_timeout_s = config.shutdown_timeout
    uvicorn_config = uvicorn.Config(app, host=config.host, port=config.port,
                                    log_level=config.uvicorn_log_level or config.log_level,
                                    http=protocol_with_header_timeout(config.header_read_timeout),
                                    timeout_keep_alive=config.keep_alive_timeout,  # type: ignore[arg-type]
                                    timeout_graceful_shutdown=_FLUSH_MARGIN_S,  # type: ignore[arg-type]
                                    ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
                                    root_path=config.root_path or "",
                                    access_log=not config.disable_uvicorn_access_log)
    # uvicorn re-raises the signals it caught once it is done (none: DrainingServer takes them); should one come
    # between, the drain is its whole effect, so it lands on a no-op handler and the process exits 0.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        DrainingServer(uvicorn_config, engine, drain_timeout_s).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ignore(_sig: int, _frame: Any) -> None:
    return None
