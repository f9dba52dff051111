"""vLLM's tokenizer endpoints, so that clients such as lm-evaluation-harness need no local tokenizer:
POST /tokenize, POST /detokenize, GET /tokenizer_info (`?model=` when several models are served)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from moe_serve.api import protocol as p
from moe_serve.server import serving
from moe_serve.server.routes.openai import ERRORS

router = APIRouter()


@router.post("/tokenize", response_model=p.TokenizeResponse, responses=ERRORS)
async def tokenize(body: p.TokenizeRequest, request: Request) -> p.TokenizeResponse:
    return await serving.tokenize(request.app.state.ctx, body)


@router.post("/detokenize", response_model=p.DetokenizeResponse, responses=ERRORS)
async def detokenize(body: p.DetokenizeRequest, request: Request) -> p.DetokenizeResponse:
    return await serving.detokenize(request.app.state.ctx, body)


@router.get("/tokenizer_info", response_model=p.TokenizerInfo, responses=ERRORS)
async def tokenizer_info(request: Request, model: str | None = None) -> p.TokenizerInfo:
    return serving.tokenizer_info(request.app.state.ctx, model)
