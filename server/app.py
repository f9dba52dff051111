"""create_app: the FastAPI application around one AsyncEngine per served model."""

from __future__ import annotations

import gc
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import Scope

from moe_serve.engine.async_engine import AsyncEngine
from moe_serve.exporters.onnx.cache import load_servable
from moe_serve.registry import bundled_models
from moe_serve.server.batches import BatchService
from moe_serve.server.errors import install_error_handlers
from moe_serve.server.lifecycle import Lifecycle
from moe_serve.server.metrics import Metrics
from moe_serve.server.middleware import AccessLogMiddleware, AdmissionMiddleware, ApiKeyMiddleware, BodyLimitMiddleware
from moe_serve.server.openapi import clean_openapi
from moe_serve.server.routes import batches, dashboard, openai, ops, pooling, tokenizer
from moe_serve.server.serving import ServedModel, ServingContext
from moe_serve.server.settings import UPLOAD_PATHS, ServerSettings

PREPARE_THREADS = 4  # tokenizing and template rendering run here, never on the event loop


def load_models(settings: ServerSettings, metrics: Metrics) -> dict[str, ServedModel]:
    names = settings.models or tuple(bundled_models())
    if not names:
        raise SystemExit("no model given and no bundled demo models found")
    served = {}
    for name in names:
        model = load_servable(name, settings.engine)
        engine = AsyncEngine.start(model, settings.engine, track_expert_load=settings.expert_metrics != "off")
        model_name, *aliases = settings.served_model_name or (engine.artifact.name,)
        metrics.watch(model_name, engine, engine.artifact.quality)
        served[model_name] = ServedModel(model_name, engine.artifact, engine, int(time.time()), tuple(aliases))
    return served


def create_app(
    settings: ServerSettings, models: dict[str, ServedModel] | None = None, metrics: Metrics | None = None
) -> FastAPI:
    metrics = metrics or Metrics(settings.expert_metrics)
    served = models if models is not None else load_models(settings, metrics)
    executor = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")

    lifecycle = Lifecycle()
    ctx = ServingContext(served, settings, metrics, executor)
    batch_service = BatchService(ctx, lifecycle)

    async def drain() -> None:
        await batch_service.stop()  # batch lines in flight are dropped: they run again after a restart
        await lifecycle.drain([model.engine for model in served.values()], settings.drain_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await batch_service.start()
        # What start-up built (the models, their engines, the app: 170,000-220,000 tracked objects) lives as
        # long as the server: moved out of the collector's view, so that a full collection under load scans only
        # the requests' objects. Traced with gc.callbacks on the demos (benchmarks/fair_share.py): full
        # collections of that heap took 35-320 ms during start-up; after the freeze, none under a 256-input
        # /v1/score beside short completions took over 10 ms.
        gc.collect()
        gc.freeze()
        yield
        await drain()  # already done when a signal started it; else (an embedding app stopping) now
        executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="moe-serve", version="0.1.0", lifespan=lifespan)
    app.state.ctx = ctx
    app.state.lifecycle = lifecycle
    app.state.batches = batch_service
    app.state.drain = drain
    install_error_handlers(app)
    for router in (openai.router, pooling.router, batches.router, tokenizer.router, ops.router, dashboard.router):
        app.include_router(router)
    clean_openapi(app)

    def endpoint_of(scope: Scope) -> str:
        """The route template the request matched (the router records it in the scope): a bounded label
        set, whatever paths clients send."""
        return getattr(scope.get("route"), "path", None) or "unmatched"

    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        max_upload_bytes=settings.max_upload_bytes,
        upload_paths=UPLOAD_PATHS,
    )
    app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, open_paths=settings.open_paths)
    app.add_middleware(AdmissionMiddleware, max_requests=settings.max_concurrent_requests, lifecycle=lifecycle)
    app.add_middleware(AccessLogMiddleware, metrics=metrics, endpoint_of=endpoint_of)
    return app
