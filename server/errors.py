"""Exception handlers: every failure a handler raises becomes the one error envelope of
moe_serve.api.errors (FastAPI's 422 becomes a 400 naming the field)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_serve.api.errors import ApiError, api_error, validation_message
from moe_serve.errors import (
    ClientDisconnectedError,
    EngineOverloadedError,
    EngineStoppedError,
    ModelNotFoundError,
    NonFiniteError,
    NotFoundError,
    UnavailableError,
    ValidationError,
)
from moe_serve.server.middleware import error_response


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return error_response(ApiError(400, message, "invalid_request_error", param))

    async def _expected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(api_error(exc))

    # Failures a client causes or must know about; anything else reaches AccessLogMiddleware (logged, 500).
    for kind in (
        ValidationError,
        ModelNotFoundError,
        NotFoundError,
        UnavailableError,
        EngineOverloadedError,
        EngineStoppedError,
        NonFiniteError,
        ClientDisconnectedError,
    ):
        app.add_exception_handler(kind, _expected)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(
            ApiError(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None) or {})
        )
