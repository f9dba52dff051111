"""/health and /ready (open even when an API key is set: probes) and /metrics."""

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
    if request.app.state.lifecycle.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ready", "models": list(request.app.state.ctx.models)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
