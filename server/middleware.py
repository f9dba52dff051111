"""Plain-ASGI middleware (so handlers still see client disconnects), outermost first: request id +
access log + request counter, body size limit, API key."""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from moe_serve.api.errors import ApiError, api_error
from moe_serve.server.metrics import Metrics

access_log = logging.getLogger("moe_serve.access")
logger = logging.getLogger("moe_serve.server")


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)


class AccessLogMiddleware:
    """Request id (X-Request-Id honoured or generated), the request counter, one JSON access-log line
    written when the response (streamed or not) is complete, and a sanitized 500 for anything unexpected."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = dict(scope["headers"]).get(b"x-request-id", b"").decode() or uuid.uuid4().hex
        state = scope.setdefault("state", {})  # what handlers see as request.state
        state["request_id"] = request_id
        start = time.monotonic()
        status = 0

        async def send_with_id(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            logger.exception("request %s failed", request_id)
            if not status:
                await error_response(api_error(exc, request_id))(scope, receive, send_with_id)
        finally:
            path = scope["path"]
            if path.startswith("/v1/"):
                self.metrics.requests.labels(path, str(status or 500), state.get("model") or "").inc()
            access_log.info(
                json.dumps(
                    {
                        "request_id": request_id,
                        "method": scope["method"],
                        "path": path,
                        "status": status or 500,
                        "model": state.get("model"),
                        "k": state.get("k"),
                        "prompt_tokens": state.get("prompt_tokens"),
                        "completion_tokens": state.get("completion_tokens"),
                        "latency_ms": round((time.monotonic() - start) * 1000, 1),
                    }
                )
            )


class ApiKeyMiddleware:
    """Bearer auth on /v1/*, compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            message = "missing API key (send Authorization: Bearer <key>)" if not given else "invalid API key"
            error = ApiError(401, message, "authentication_error", headers={"WWW-Authenticate": "Bearer"})
            return await error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over the limit, whether announced by Content-Length or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = error_response(
            ApiError(413, f"request body exceeds {self.max_bytes} bytes", "invalid_request_error")
        )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await too_large(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await too_large(scope, receive, send)


class _BodyTooLarge(Exception):
    pass
