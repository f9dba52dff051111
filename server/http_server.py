"""The uvicorn server `moe-serve serve` runs, with what uvicorn leaves to the application: a drain on the
first SIGTERM or SIGINT (server.lifecycle), a time limit on request headers, and the connection limit in the
error envelope (server.middleware.ConnectionLimitMiddleware)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from moe_serve.server.lifecycle import FLUSH_SECONDS, Lifecycle
from moe_serve.server.middleware import ConnectionLimitMiddleware

if TYPE_CHECKING:
    from fastapi import FastAPI

    from moe_serve.server.settings import ServerSettings

logger = logging.getLogger("moe_serve.server")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM or SIGINT drains (see the module docstring); a second one
    stops at once."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, drain: Callable[[], asyncio.Future]) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self._start_drain = drain
        self._drain: asyncio.Future | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.draining or sig not in (signal.SIGTERM, signal.SIGINT):
            return super().handle_exit(sig, frame)
        logger.info("signal %d: draining (a second signal stops at once)", sig)
        self.lifecycle.draining = True  # a flag only: a signal handler must not touch the event loop

    async def on_tick(self, counter: int) -> bool:
        if self.lifecycle.draining and self._drain is None and not self.should_exit:
            self._drain = asyncio.ensure_future(self._start_drain())
        if self._drain is not None and self._drain.done():
            return True
        return await super().on_tick(counter)


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """The h11 protocol with a deadline for a request's headers: a client that opens a connection and
    sends headers slowly (or not at all) is disconnected after `seconds`, so it cannot hold a connection
    slot for ever. Idle keep-alive connections are uvicorn's `timeout_keep_alive`."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                self._arm()  # the start of a request (the first, or the next on a keep-alive connection)
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # its headers are complete

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


def build_server(app: FastAPI, settings: ServerSettings) -> DrainingServer:
    """The uvicorn server `moe-serve serve` runs: draining on signals, bounded connections, header and
    keep-alive timeouts, no uvicorn access log (the application writes its own)."""
    # The connection limit is ours (the error envelope, Retry-After), not uvicorn's plain-text 503.
    limited = ConnectionLimitMiddleware(app, settings.max_connections)
    config = uvicorn.Config(
        limited,
        host=settings.host,
        port=settings.port,
        http=header_timeout_protocol(settings.header_timeout),
        log_level=settings.log_level,
        access_log=False,
        limit_concurrency=None,  # see ConnectionLimitMiddleware
        timeout_keep_alive=max(1, round(settings.keep_alive_timeout)),
        timeout_graceful_shutdown=round(FLUSH_SECONDS) + 1,  # what is left once the drain is over
    )
    lifecycle: Lifecycle = app.state.lifecycle
    server = DrainingServer(config, lifecycle, app.state.drain)
    limited.server_state = server.server_state
    return server
