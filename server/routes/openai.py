"""/v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request

from moe_serve.api import protocol as p
from moe_serve.server import serving

router = APIRouter(prefix="/v1")
ERRORS = {code: {"model": p.ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)}


@router.post("/completions", response_model=p.CompletionResponse, responses=ERRORS)
async def completions(body: p.CompletionRequest, request: Request):
    return await serving.completions(request.app.state.ctx, body, request)


@router.post("/chat/completions", response_model=p.ChatCompletionResponse, responses=ERRORS)
async def chat_completions(body: p.ChatCompletionRequest, request: Request):
    return await serving.chat_completions(request.app.state.ctx, body, request)


@router.get("/models", response_model=p.ModelList, responses=ERRORS)
async def models(request: Request) -> p.ModelList:
    return p.ModelList(data=[m.card() for m in request.app.state.ctx.models.values()])
