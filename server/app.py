"""create_app: the FastAPI application around one AsyncEngine per served model."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from moe_serve.engine.async_engine import AsyncEngine
from moe_serve.registry import bundled_models
from moe_serve.server.errors import install_error_handlers
from moe_serve.server.metrics import Metrics
from moe_serve.server.middleware import AccessLogMiddleware, ApiKeyMiddleware, BodyLimitMiddleware
from moe_serve.server.routes import dashboard, openai, ops, pooling
from moe_serve.server.serving import ServedModel, ServingContext
from moe_serve.server.settings import ServerSettings


def load_models(settings: ServerSettings, metrics: Metrics) -> dict[str, ServedModel]:
    names = settings.models or tuple(bundled_models())
    if not names:
        raise SystemExit("no model given and no bundled demo models found")
    served = {}
    for name in names:
        engine = AsyncEngine.load(name, settings.engine, track_expert_load=settings.expert_metrics != "off")
        model_name = engine.artifact.name
        metrics.watch(model_name, engine, engine.artifact.quality)
        served[model_name] = ServedModel(model_name, engine.artifact, engine, int(time.time()))
    return served


def create_app(
    settings: ServerSettings, models: dict[str, ServedModel] | None = None, metrics: Metrics | None = None
) -> FastAPI:
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
