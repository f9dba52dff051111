"""The server's lifecycle state: whether it drains, and the API requests in flight (what a drain waits for);
server.http_server starts the drain on SIGTERM.

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
import time
from collections.abc import Iterable

from moe_serve.engine.async_engine import AsyncEngine

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
