"""Draining on SIGTERM, and a time limit on request headers: what uvicorn leaves to the application.

uvicorn's own shutdown closes the listening socket first (new clients get a TCP reset, never a 503) and
cancels what is still running past its timeout (a plain-text 500, streams cut without an error event).
Here a signal starts a drain instead: the server keeps listening, `/ready` turns 503, new API requests get
503 with Retry-After, and requests in flight may finish for `drain_timeout` seconds. Then the engines stop,
which fails whatever is left with a 503 in the error envelope (in-band for streams, followed by `[DONE]`),
and only then does uvicorn close its sockets.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import TYPE_CHECKING

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from moe_serve.engine.async_engine import AsyncEngine
from moe_serve.server.middleware import ConnectionLimitMiddleware

if TYPE_CHECKING:
    from fastapi import FastAPI

    from moe_serve.server.settings import ServerSettings

logger = logging.getLogger("moe_serve.server")
FLUSH_SECONDS = 2.0  # after the engines stop: time for the failed requests' responses to be written


class Lifecycle:
    """Whether the server drains, and how many API requests are in flight (counted by the admission
    middleware): what a drain waits for; and how many of them are interactive (model work a client waits
    on): what the Batch API's worker yields to."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self.interactive = 0
        self._stopped = False

    async def drain(self, engines: Iterable[AsyncEngine], timeout: float) -> None:
        """Refuse new requests, let those in flight finish for `timeout` seconds, then stop the engines
        (failing what is left) and give the failures a moment to reach their clients. Idempotent."""
        self.draining = True
        if self._stopped:
            return
        await self._until_idle(timeout)
        self._stopped = True
        if self.in_flight:
            logger.warning("drain timeout: failing %d request(s) still in flight", self.in_flight)
        loop = asyncio.get_running_loop()
        for engine in engines:
            await loop.run_in_executor(None, engine.shutdown)
        await self._until_idle(FLUSH_SECONDS)

    async def _until_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


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
