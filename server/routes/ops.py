"""/health, /ready and /metrics: open even when an API key is set."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter()


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    if request.app.state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ready", "models": list(request.app.state.ctx.models)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx = request.app.state.ctx
    for name, served in ctx.models.items():  # queue gauges read live, not only after engine steps
        ctx.metrics.running.labels(name).set(served.engine.num_running)
        ctx.metrics.waiting.labels(name).set(served.engine.num_waiting)
    return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
