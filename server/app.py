"""create_app: the FastAPI application around one AsyncEngine per served model.

Middleware (outermost first): request id + access log + request counter, body size limit, API key.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from moe_serve.artifact import load_artifact
from moe_serve.config import EngineConfig
from moe_serve.engine.async_engine import AsyncEngine
from moe_serve.engine.llm_engine import LLMEngine
from moe_serve.registry import bundled_models, resolve_model
from server.errors import error_response, install_error_handlers
from server.metrics import Metrics
from server.routes import dashboard, ops, openai, pooling
from server.serving import ServedModel, ServingContext
from server.settings import ServerSettings

access_log = logging.getLogger("moe_serve.access")
logger = logging.getLogger("moe_serve.server")


def load_models(settings: ServerSettings, metrics: Metrics) -> dict[str, ServedModel]:
    names = settings.models or tuple(bundled_models())
    if not names:
        raise SystemExit("no model given and no bundled demo models found")
    engine_config = EngineConfig(device=settings.device, max_num_seqs=settings.max_num_seqs,
                                 max_model_len=settings.max_model_len, kv_cache_tokens=settings.kv_cache_tokens)
    served = {}
    for name in names:
        artifact = load_artifact(resolve_model(name), device=engine_config.torch_device(), dtype=engine_config.torch_dtype())
        model_name = artifact.path.name
        if settings.expert_metrics != "off":
            artifact.model.track_expert_load()
        engine = LLMEngine(artifact, engine_config, engine_config.torch_device())
        metrics.register_model(model_name, artifact)
        hook = _metrics_hook(metrics, model_name)
        served[model_name] = ServedModel(model_name, artifact, AsyncEngine(engine, settings.max_waiting, hook), int(time.time()))
    return served


def _metrics_hook(metrics: Metrics, name: str):
    def on_step(engine: AsyncEngine) -> None:
        llm_engine = engine.engine
        metrics.record_engine(name, engine.num_running, engine.num_waiting,
                              llm_engine.num_reserved_tokens / llm_engine.kv_cache_tokens, llm_engine.artifact.model.read_expert_load())
    return on_step


def create_app(settings: ServerSettings, models: dict[str, ServedModel] | None = None, metrics: Metrics | None = None) -> FastAPI:
    metrics = metrics or Metrics(settings.expert_metrics)
    served = models if models is not None else load_models(settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # Shutdown (uvicorn has stopped accepting and waited for open requests): let engines finish, then stop.
        app.state.draining = True
        for model in served.values():
            await model.engine.drain(settings.drain_timeout)
            model.engine.shutdown()

    app = FastAPI(title="moe-serve", version="0.1.0", lifespan=lifespan)
    app.state.ctx = ServingContext(served, settings, metrics)
    app.state.draining = False
    install_error_handlers(app)
    app.include_router(openai.router)
    app.include_router(pooling.router)
    app.include_router(ops.router)
    app.include_router(dashboard.router)
    app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AccessLogMiddleware, metrics=metrics)
    return app


class AccessLogMiddleware:
    """Request id (X-Request-Id honoured or generated), the request counter, one JSON access-log line
    written when the response (streamed or not) is complete, and a sanitized 500 for anything unexpected.
    Plain ASGI, so that handlers still see client disconnects."""

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
        except Exception:
            logger.exception("request %s failed", request_id)
            if not status:
                await error_response(500, f"internal server error (request id {request_id})", "internal_error")(scope, receive, send_with_id)
        finally:
            path = scope["path"]
            if path.startswith("/v1/"):
                self.metrics.requests.labels(path, str(status or 500), state.get("model") or "").inc()
            access_log.info(json.dumps({
                "request_id": request_id, "method": scope["method"], "path": path, "status": status or 500,
                "model": state.get("model"), "k": state.get("k"), "prompt_tokens": state.get("prompt_tokens"),
                "completion_tokens": state.get("completion_tokens"), "latency_ms": round((time.monotonic() - start) * 1000, 1),
            }))


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
            response = error_response(401, message, "authentication_error", headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over the limit, whether announced by Content-Length or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = error_response(413, f"request body exceeds {self.max_bytes} bytes", "invalid_request_error")
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
