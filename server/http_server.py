"""The uvicorn server `moe-serve serve` runs, with what uvicorn leaves to the application: a drain on the
first SIGTERM or SIGINT (server.lifecycle), a time limit on request headers, and the connection limit in the
error envelope: on requests (server.middleware.ConnectionLimitMiddleware) and, past the probes' room, on
connections as they are accepted, within the open-file limit."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from moe_serve.api.errors import ApiError
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

    async def startup(self, sockets: list | None = None) -> None:
        accept_errors = RefusalLog(0, what="accepts failed for want of a file descriptor")
        default = asyncio.get_running_loop().get_exception_handler()

        def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
            # asyncio logs every failed accept with a traceback; at the descriptor limit that is a flood.
            if str(context.get("message", "")).startswith("socket.accept() out of system resource"):
                accept_errors.note()
            elif default is not None:
                default(loop, context)
            else:
                loop.default_exception_handler(context)

        asyncio.get_running_loop().set_exception_handler(handle)
        await super().startup(sockets)

    async def on_tick(self, counter: int) -> bool:
        if self.lifecycle.draining and self._drain is None and not self.should_exit:
            self._drain = asyncio.ensure_future(self._start_drain())
        if self._drain is not None and self._drain.done():
            return True
        return await super().on_tick(counter)


# Connections past --max-connections still accepted, so that the health probes reach the server (the
# middleware answers the others' requests 503); past both, a connection is refused as it is accepted.
PROBE_CONNECTIONS = 16
# The listen queue, which is also how many connections asyncio accepts in one go: a burst is accepted (a
# descriptor each) for a few loop iterations before the first is refused, so the limit leaves room for it.
ACCEPT_BACKLOG = 64
ACCEPTED_BEFORE_REFUSED = 4 * ACCEPT_BACKLOG
# Files the process may open after start-up: the data dir's database and files, uploads, logs.
FILES_HEADROOM = 64
REFUSAL_LOG_SECONDS = 1.0


def descriptors_in_use() -> int:
    """The process's open descriptors now (model files, threads' pipes, the listening socket)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux
        return 256


def connection_limit(max_connections: int) -> int:
    """--max-connections as the open-file limit allows it: the soft limit is raised (up to the hard one) to
    hold that many connections, the probes' room, a burst being accepted and the process's own files; where
    it cannot be, the limit is lowered to fit, with a warning naming both, so that connections never exhaust
    the descriptors (an accept that fails for want of one is retried and logged by asyncio in a loop)."""
    import resource

    beside = descriptors_in_use() + FILES_HEADROOM + ACCEPTED_BEFORE_REFUSED
    want = max_connections + PROBE_CONNECTIONS + beside
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return max_connections
    raised = want if hard == resource.RLIM_INFINITY else min(want, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        soft = raised
    except (ValueError, OSError):
        pass
    if soft >= want:
        return max_connections
    fitted = soft - PROBE_CONNECTIONS - beside
    if fitted < 1:
        raise ValueError(
            f"the open-file limit (ulimit -n) is {soft}: this server needs at least {PROBE_CONNECTIONS + beside + 1} "
            "descriptors; raise it"
        )
    logger.warning(
        "--max-connections %d lowered to %d: the open-file limit (ulimit -n) is %d (hard %s) and the server keeps "
        "%d descriptors for its own files and bursts of connections and %d for health probes; raise the limit "
        "to keep %d",
        max_connections, fitted, soft, "unlimited" if hard == resource.RLIM_INFINITY else hard,
        beside, PROBE_CONNECTIONS, max_connections,
    )  # fmt: skip
    return fitted


class RefusalLog:
    """One warning a second at most for connections refused at the limit (with how many), never one per
    connection: a flood of connections must not become a flood of log lines."""

    def __init__(self, limit: int, interval: float = REFUSAL_LOG_SECONDS, what: str = "") -> None:
        self.what = what or (
            f"connections refused (503): {limit} open, the limit (--max-connections plus {PROBE_CONNECTIONS} for "
            "health probes)"
        )
        self.interval = interval
        self.count = 0
        self._last = -interval

    def note(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._last >= self.interval:
            since = "since start-up" if self._last < 0 else f"in the last {now - self._last:.0f} s"
            logger.warning("%d %s, %s", self.count, self.what, since)
            self.count, self._last = 0, now


def refusal_bytes(max_connections: int) -> bytes:
    """The 503 a connection past the limit gets as it is accepted: the error envelope, Retry-After, closed."""
    message = f"the server has its maximum of {max_connections} connections open; retry later"
    body = json.dumps(ApiError(503, message, "service_unavailable").body()).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def server_protocol(header_seconds: float, max_connections: int) -> type[H11Protocol]:
    """The h11 protocol with a deadline for a request's headers: a client that opens a connection and
    sends headers slowly (or not at all) is disconnected after `header_seconds`, so it cannot hold a
    connection slot for ever (idle keep-alive connections are uvicorn's `timeout_keep_alive`); and a
    connection past `max_connections` + PROBE_CONNECTIONS gets the 503 envelope and is closed as it is
    accepted, so that open connections stay within the descriptors the process has."""
    limit = max_connections + PROBE_CONNECTIONS
    refusal = refusal_bytes(max_connections)
    log = RefusalLog(limit)
    seconds = header_seconds

    class ServerProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limit:
                self._refused = True
                log.note()
                transport.write(refusal)
                transport.close()
                return
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self.conn.their_state is h11.IDLE:
                self._arm()  # the start of a request (the first, or the next on a keep-alive connection)
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # its headers are complete

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
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

    return ServerProtocol


def build_server(app: FastAPI, settings: ServerSettings) -> DrainingServer:
    """The uvicorn server `moe-serve serve` runs: draining on signals, bounded connections, header and
    keep-alive timeouts, no uvicorn access log (the application writes its own)."""
    # The connection limit is ours (the error envelope, Retry-After), not uvicorn's plain-text 503.
    max_connections = connection_limit(settings.max_connections)
    limited = ConnectionLimitMiddleware(app, max_connections)
    config = uvicorn.Config(
        limited,
        host=settings.host,
        port=settings.port,
        http=server_protocol(settings.header_timeout, max_connections),
        log_level=settings.log_level,
        access_log=False,
        limit_concurrency=None,  # see ConnectionLimitMiddleware
        timeout_keep_alive=max(1, round(settings.keep_alive_timeout)),
        backlog=ACCEPT_BACKLOG,
        timeout_graceful_shutdown=round(FLUSH_SECONDS) + 1,  # what is left once the drain is over
    )
    lifecycle: Lifecycle = app.state.lifecycle
    server = DrainingServer(config, lifecycle, app.state.drain)
    limited.server_state = server.server_state
    return server
