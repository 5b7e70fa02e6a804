"""The HTTP transport under the app: uvicorn's h11 protocol with a header read timeout, and a server that drains
before it stops.

Header timeout: a connection whose request line and headers are not complete `header_timeout_s` after their
first byte (or after the connection opened) is closed, so clients trickling bytes cannot hold connections. The
body has its own timeout in the app (`BodyLimitMiddleware`), and idle keep-alive connections uvicorn's.

Drain: on SIGTERM or SIGINT the engine refuses new requests at once (503, and /health turns 503), uvicorn
stops listening and lets the open connections finish; requests still unfinished `drain_timeout_s` later are
aborted, each stream ending with an error event and `[DONE]`, each non-streaming request with a 503 body. A
second signal stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.server_config import ServerConfig

logger = logging.getLogger("kestrel.server")

# Beyond the drain: time for the last error events and 503 bodies to reach the clients before uvicorn cancels.
_FLUSH_MARGIN_S = 5.0


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
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self._drain_timer: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_timer is None:
            self.engine.begin_drain()
            logger.warning("shutting down: no new requests; %d unfinished get up to %.0f s to finish",
                           self.engine.num_unfinished, self.drain_timeout_s)
            self._drain_timer = threading.Timer(self.drain_timeout_s, self._end_unfinished)
            self._drain_timer.daemon = True
            self._drain_timer.start()
        super().handle_exit(sig, frame)

    def _end_unfinished(self) -> None:
        ended = self.engine.end_unfinished(f"the server shut down before this request finished (drain timeout "
                                           f"{self.drain_timeout_s:.0f} s)")
        if ended:
            logger.warning("drain timeout: ended %d unfinished requests", ended)


def serve(app: Any, engine: AsyncEngine, config: ServerConfig) -> None:
    drain_timeout_s = config.shutdown_timeout
    uvicorn_config = uvicorn.Config(app, host=config.host, port=config.port,
                                    log_level=config.uvicorn_log_level or config.log_level,
                                    http=protocol_with_header_timeout(config.header_read_timeout),
                                    timeout_graceful_shutdown=int(drain_timeout_s + _FLUSH_MARGIN_S),
                                    ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
                                    root_path=config.root_path or "")
    # uvicorn re-raises the signal that stopped it once it is done; the drain is that signal's whole effect, so
    # it lands on a no-op handler and the process exits 0 after the engine's own shutdown.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        DrainingServer(uvicorn_config, engine, drain_timeout_s).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ignore(_sig: int, _frame: Any) -> None:
    return None
