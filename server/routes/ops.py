"""/health, /ping, /version and /ready (open even when an API key is set: probes) and /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from moe_serve import __version__

router = APIRouter()


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ping")
@router.post("/ping", operation_id="ping_post")  # one route per method: the OpenAPI document names each once
async def ping() -> Response:
    """vLLM's (and SageMaker's) liveness probe: /health under its other name, with an empty body."""
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict:
    """vLLM's: the server's version."""
    return {"version": __version__}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    if request.app.state.lifecycle.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ready", "models": list(request.app.state.ctx.models)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
