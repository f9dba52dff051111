"""One error envelope for every failure: {"error": {"message", "type", "param", "code"}}.

validation -> 400 (FastAPI's 422 included), auth -> 401, unknown model -> 404, body too large -> 413,
overload -> 429 with Retry-After, shutting down -> 503. Anything unexpected becomes a 500 without details
in server.app.AccessLogMiddleware, which catches it (so the connection stays usable) and logs it.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_serve.engine.async_engine import EngineOverloadedError, EngineStoppedError
from moe_serve.errors import ValidationError

class ModelNotFoundError(Exception):
    def __init__(self, name: str, available: list[str]) -> None:
        super().__init__(f"model '{name}' does not exist; served models: {', '.join(available)}")


class ClientDisconnected(Exception):
    """The client closed the connection before a non-streaming response was ready (logged as 499)."""


def error_response(status: int, message: str, type_: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    error = exc.errors()[0]
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = location[0] if location else None  # the top-level field (deeper parts name union members)
    if error.get("type") == "json_invalid":
        return f"malformed JSON in the request body: {error.get('msg', '')}", None
    if error.get("type") == "missing":
        return f"{param} is required", param
    return f"{param}: {error.get('msg', 'invalid value')}" if param else error.get("msg", "invalid request"), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(ValidationError)
    async def _engine_validation(request: Request, exc: ValidationError) -> JSONResponse:
        return error_response(400, str(exc), "invalid_request_error", exc.parameter)

    @app.exception_handler(ModelNotFoundError)
    async def _not_found(request: Request, exc: ModelNotFoundError) -> JSONResponse:
        return error_response(404, str(exc), "not_found_error", "model")

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
        return error_response(429, f"server overloaded: {exc}; retry later", "rate_limit_error", headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(EngineStoppedError)
    async def _stopping(request: Request, exc: EngineStoppedError) -> JSONResponse:
        return error_response(503, str(exc), "service_unavailable", headers={"Retry-After": "5"})

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> JSONResponse:
        return error_response(499, "client closed the request", "client_closed_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None))
