"""The OpenAI Files and Batch API: /v1/files and /v1/batches (server.batches does the work). Every handler is
async: the store and the worker live on the event loop."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from moe_serve.api import batches as b
from moe_serve.api.errors import ApiError
from moe_serve.batch.store import QuotaError, StorageError
from moe_serve.server.middleware import error_response
from moe_serve.server.routes.openai import ERRORS as API_ERRORS

T = TypeVar("T")
# 507: the data dir is full (or its quota reached)
ERRORS: dict[int | str, dict[str, Any]] = {**API_ERRORS, 507: API_ERRORS[503]}
STORAGE_RETRY_AFTER = "30"  # seconds a client is told to wait when the data dir fails


def storage_response(exc: StorageError) -> JSONResponse:
    """The data dir failing, in the one envelope: 507 when it is full (or the quota is reached), else 503."""
    if exc.is_full:
        return error_response(ApiError(507, str(exc), "insufficient_storage", exc.parameter))
    headers = {"Retry-After": STORAGE_RETRY_AFTER}
    return error_response(ApiError(503, str(exc), "service_unavailable", exc.parameter, headers=headers))


def data_dir_errors(handler: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T | JSONResponse]]:
    """A route whose data dir may fail: StorageError answered as storage_response, and counted."""

    @functools.wraps(handler)
    async def route(*args: Any, **kwargs: Any) -> T | JSONResponse:
        try:
            return await handler(*args, **kwargs)
        except StorageError as exc:
            if not isinstance(exc, QuotaError):
                kwargs["request"].app.state.ctx.metrics.batch_storage_errors.labels("request").inc()
            return storage_response(exc)

    return route


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
@data_dir_errors
async def upload_file(request: Request) -> b.FileObject:
    return await request.app.state.batches.upload(request)


@router.get("/files", response_model=b.FileList, responses=ERRORS)
@data_dir_errors
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> b.FileList:
    return request.app.state.batches.list_files(purpose, limit, order, after)


@router.get("/files/{file_id}", response_model=b.FileObject, responses=ERRORS)
@data_dir_errors
async def get_file(file_id: str, request: Request) -> b.FileObject:
    return request.app.state.batches.get_file(file_id)


@router.get("/files/{file_id}/content", response_class=StreamingResponse, responses=ERRORS)
@data_dir_errors
async def file_content(file_id: str, request: Request) -> StreamingResponse:
    return request.app.state.batches.file_content(file_id)


@router.delete("/files/{file_id}", response_model=b.FileDeleted, responses=ERRORS)
@data_dir_errors
async def delete_file(file_id: str, request: Request) -> b.FileDeleted:
    return request.app.state.batches.delete_file(file_id)


@router.post("/batches", response_model=b.Batch, responses=ERRORS)
@data_dir_errors
async def create_batch(body: b.CreateBatchRequest, request: Request) -> b.Batch:
    return request.app.state.batches.create_batch(body)


@router.get("/batches", response_model=b.BatchList, responses=ERRORS)
@data_dir_errors
async def list_batches(
    request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None
) -> b.BatchList:
    return request.app.state.batches.list_batches(limit, after)


@router.get("/batches/{batch_id}", response_model=b.Batch, responses=ERRORS)
@data_dir_errors
async def get_batch(batch_id: str, request: Request) -> b.Batch:
    return request.app.state.batches.get_batch(batch_id)


@router.post("/batches/{batch_id}/cancel", response_model=b.Batch, responses=ERRORS)
@data_dir_errors
async def cancel_batch(batch_id: str, request: Request) -> b.Batch:
    return request.app.state.batches.cancel_batch(batch_id)
