"""Plain-ASGI middleware (so handlers still see client disconnects), outermost first: the connection limit
(around the application, installed by server.http_server.build_server), request id + access log + request
counter, admission (draining, concurrency limit), API key, body size limit."""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.server import ServerState

from moe_serve.api.errors import ApiError, api_error
from moe_serve.errors import ClientDisconnectedError
from moe_serve.server.lifecycle import Lifecycle
from moe_serve.server.metrics import Metrics
from moe_serve.server.settings import OPEN_PATHS, is_api_path, is_interactive_path

access_log = logging.getLogger("moe_serve.access")
logger = logging.getLogger("moe_serve.server")
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)


class AccessLogMiddleware:
    """Request id (a well-formed X-Request-Id honoured, else generated), the request counter (labelled by
    route template: a bounded set), one JSON access-log line when the response (streamed or not) is
    complete, and a sanitized 500 for anything unexpected."""

    def __init__(self, app: ASGIApp, metrics: Metrics, endpoint_of: Callable[[Scope], str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoint_of = endpoint_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})  # what handlers see as request.state
        state["request_id"] = request_id
        start = time.monotonic()
        status, complete = 0, False

        async def send_with_id(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
            if status and not complete:  # a response (a stream) that ended before its end: the client left
                status = 499
        except (ClientDisconnectedError, ClientDisconnect):  # ours, or Starlette's (a stream written to a gone client)
            status = 499 if not complete else status
        except Exception as exc:
            logger.exception("request %s failed", request_id)
            if not status:
                await error_response(api_error(exc, request_id))(scope, receive, send_with_id)
        finally:
            endpoint = self.endpoint_of(scope)
            if is_api_path(endpoint):
                self.metrics.requests.labels(endpoint, str(status or 500), state.get("model") or "").inc()
            access_log.info(
                json.dumps(
                    {
                        "request_id": request_id,
                        "method": scope["method"],
                        "path": endpoint,
                        "status": status or 500,
                        "model": state.get("model"),
                        "k": state.get("k"),
                        "prompt_tokens": state.get("prompt_tokens"),
                        "completion_tokens": state.get("completion_tokens"),
                        "latency_ms": round((time.monotonic() - start) * 1000, 1),
                    }
                )
            )


class ConnectionLimitMiddleware:
    """uvicorn's `limit_concurrency`, answered in the error envelope: while more than `max_connections`
    connections are open (idle keep-alive ones and those still sending headers included) or more than that
    many requests are being handled, a request gets 503 with Retry-After and its connection is closed. The
    health probes are exempt (a full server is alive). `server_state` is the uvicorn server's (its sets of
    connections and request tasks), attached once the server exists; until then nothing is refused.
    Outermost, before the access log: the refusal is cheap, made before the body is read."""

    def __init__(self, app: ASGIApp, max_connections: int, exempt: tuple[str, ...] = OPEN_PATHS) -> None:
        self.app = app
        self.max_connections = max_connections
        self.exempt = exempt
        self.server_state: ServerState | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.server_state
        if (
            scope["type"] == "http"
            and state is not None
            and scope["path"] not in self.exempt
            and max(len(state.connections), len(state.tasks)) > self.max_connections
        ):
            message = f"the server has its maximum of {self.max_connections} connections open; retry later"
            error = ApiError(503, message, "service_unavailable", headers={"Retry-After": "1", "Connection": "close"})
            return await error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


class AdmissionMiddleware:
    """503 with Retry-After, in the error envelope, for API requests while the server drains or while it
    already handles its maximum of requests. Counts the requests in flight (what a drain waits for)."""

    def __init__(self, app: ASGIApp, max_requests: int, lifecycle: Lifecycle) -> None:
        self.app = app
        self.max_requests = max_requests
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_api_path(scope["path"]):
            return await self.app(scope, receive, send)
        lifecycle = self.lifecycle
        if lifecycle.draining:
            error = ApiError(503, "the server is shutting down", "service_unavailable", headers={"Retry-After": "5"})
            return await error_response(error)(scope, receive, send)
        if lifecycle.in_flight >= self.max_requests:
            message = f"the server is handling its maximum of {self.max_requests} requests; retry later"
            error = ApiError(503, message, "service_unavailable", headers={"Retry-After": "1"})
            return await error_response(error)(scope, receive, send)
        interactive = is_interactive_path(scope["path"])
        lifecycle.in_flight += 1
        lifecycle.interactive += interactive
        try:
            await self.app(scope, receive, send)
        finally:
            lifecycle.in_flight -= 1
            lifecycle.interactive -= interactive


class ApiKeyMiddleware:
    """Bearer auth on everything but the open paths (the health probes, and monitoring when it is made
    public), compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str | None, open_paths: tuple[str, ...]) -> None:
        self.app = app
        self.expected = api_key.encode() if api_key else None
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, credentials = given.strip().partition(b" ")
        # The scheme is case-insensitive (RFC 9110: "bearer" is "Bearer"); the key itself is compared exactly.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(credentials.strip(), self.expected):
            message = "missing API key (send Authorization: Bearer <key>)" if not given else "invalid API key"
            error = ApiError(401, message, "authentication_error", headers={"WWW-Authenticate": "Bearer"})
            return await error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


class _BodyTooLarge(Exception):
    """An upload outgrew its limit while the application read it."""


class BodyLimitMiddleware:
    """413 for bodies over the limit, announced by Content-Length or not (chunked): the body is read here,
    up to the limit, before the application sees any of it. Uploads (`upload_paths`) have their own, larger
    limit and reach the application as they arrive (it writes them into the data dir), counted on the way."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, max_upload_bytes: int = 0, upload_paths: tuple[str, ...] = ()
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_upload_bytes = max_upload_bytes
        self.upload_paths = upload_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        is_upload = scope["path"] in self.upload_paths
        limit = self.max_upload_bytes if is_upload else self.max_bytes
        too_large = error_response(ApiError(413, f"request body exceeds {limit} bytes", "invalid_request_error"))
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await too_large(scope, receive, send)
        if is_upload:
            return await self._streamed(scope, receive, send, too_large)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnects still arrive

        return await self.app(scope, replay, send)

    async def _streamed(self, scope: Scope, receive: Receive, send: Send, too_large: JSONResponse) -> None:
        size, started = 0, False

        async def counted() -> Message:
            nonlocal size
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > self.max_upload_bytes:
                    raise _BodyTooLarge
            return message

        async def send_started(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, send_started)
        except _BodyTooLarge:
            if not started:
                await too_large(scope, receive, send)
