"""/v1/completions, /v1/chat/completions, /v1/models and /v1/models/{model}."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from moe_serve.api import protocol as p
from moe_serve.server import serving
from moe_serve.server.serving import split_k_suffix

router = APIRouter(prefix="/v1")
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": p.ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)
}


@router.post("/completions", response_model=p.CompletionResponse, responses=ERRORS)
async def completions(body: p.CompletionRequest, request: Request):
    return await serving.completions(request.app.state.ctx, body, request)


@router.post("/chat/completions", response_model=p.ChatCompletionResponse, responses=ERRORS)
async def chat_completions(body: p.ChatCompletionRequest, request: Request):
    return await serving.chat_completions(request.app.state.ctx, body, request)


@router.get("/models", response_model=p.ModelList, responses=ERRORS)
async def models(request: Request) -> p.ModelList:
    return p.ModelList(data=[card for m in request.app.state.ctx.models.values() for card in m.cards()])


@router.get("/models/{model}", response_model=p.ModelCard, responses=ERRORS)
async def model(model: str, request: Request) -> p.ModelCard:
    ctx = request.app.state.ctx
    name, k = split_k_suffix(model, ctx.names)
    return ctx.model(name).card(k)
