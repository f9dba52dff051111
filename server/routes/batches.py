"""The OpenAI Files and Batch API: /v1/files and /v1/batches (server.batches does the work). Every handler is
async: the store and the worker live on the event loop."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from moe_serve.api import batches as b
from moe_serve.server.routes.openai import ERRORS

router = APIRouter(prefix="/v1")
UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}


@router.post("/files", response_model=b.FileObject, responses=ERRORS, openapi_extra=UPLOAD_BODY)
async def upload_file(request: Request) -> b.FileObject:
    return await request.app.state.batches.upload(request)


@router.get("/files", response_model=b.FileList, responses=ERRORS)
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> b.FileList:
    return request.app.state.batches.list_files(purpose, limit, order, after)


@router.get("/files/{file_id}", response_model=b.FileObject, responses=ERRORS)
async def get_file(file_id: str, request: Request) -> b.FileObject:
    return request.app.state.batches.get_file(file_id)


@router.get("/files/{file_id}/content", response_class=StreamingResponse, responses=ERRORS)
async def file_content(file_id: str, request: Request) -> StreamingResponse:
    return request.app.state.batches.file_content(file_id)


@router.delete("/files/{file_id}", response_model=b.FileDeleted, responses=ERRORS)
async def delete_file(file_id: str, request: Request) -> b.FileDeleted:
    return request.app.state.batches.delete_file(file_id)


@router.post("/batches", response_model=b.Batch, responses=ERRORS)
async def create_batch(body: b.CreateBatchRequest, request: Request) -> b.Batch:
    return request.app.state.batches.create_batch(body)


@router.get("/batches", response_model=b.BatchList, responses=ERRORS)
async def list_batches(
    request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None
) -> b.BatchList:
    return request.app.state.batches.list_batches(limit, after)


@router.get("/batches/{batch_id}", response_model=b.Batch, responses=ERRORS)
async def get_batch(batch_id: str, request: Request) -> b.Batch:
    return request.app.state.batches.get_batch(batch_id)


@router.post("/batches/{batch_id}/cancel", response_model=b.Batch, responses=ERRORS)
async def cancel_batch(batch_id: str, request: Request) -> b.Batch:
    return request.app.state.batches.cancel_batch(batch_id)
