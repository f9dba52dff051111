"""/v1/classify and /v1/score."""

from __future__ import annotations

from fastapi import APIRouter, Request

from moe_serve.api import protocol as p
from moe_serve.server import serving
from moe_serve.server.routes.openai import ERRORS

router = APIRouter(prefix="/v1")


@router.post("/classify", response_model=p.ClassifyResponse, responses=ERRORS)
async def classify(body: p.ClassifyRequest, request: Request) -> p.ClassifyResponse:
    return await serving.classify(request.app.state.ctx, body, request)


@router.post("/score", response_model=p.ScoreResponse, responses=ERRORS)
async def score(body: p.ScoreRequest, request: Request) -> p.ScoreResponse:
    return await serving.score(request.app.state.ctx, body, request)
