"""The one error envelope, `{"error": {"message", "type", "param", "code"}}`, for every transport: an HTTP
body, an SSE event inside a stream, a batch output line. `api_error(exc)` is the one mapping from an
exception to what a client sees; anything unexpected becomes a 500 that reveals nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pydantic

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


@dataclass(frozen=True, slots=True)
class ApiError:
    status: int
    message: str
    type: str
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def api_error(exc: BaseException, request_id: str | None = None) -> ApiError:
    """What the client sees for `exc`. Unexpected exceptions never leak their message."""
    if isinstance(exc, ValidationError):
        return ApiError(400, str(exc), "invalid_request_error", exc.parameter)
    if isinstance(exc, pydantic.ValidationError):
        message, param = validation_message(exc.errors())
        return ApiError(400, message, "invalid_request_error", param)
    if isinstance(exc, ModelNotFoundError):
        return ApiError(404, str(exc), "not_found_error", "model")
    if isinstance(exc, NotFoundError):
        return ApiError(404, str(exc), "not_found_error", exc.parameter)
    if isinstance(exc, EngineOverloadedError):
        return ApiError(
            429,
            f"server overloaded: {exc}; retry later",
            "rate_limit_error",
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, NonFiniteError):
        return ApiError(422, str(exc), "invalid_request_error")
    if isinstance(exc, EngineStoppedError):
        return ApiError(503, str(exc), "service_unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, UnavailableError):
        return ApiError(503, str(exc), "service_unavailable")
    if isinstance(exc, ClientDisconnectedError):
        return ApiError(499, "client closed the request", "client_closed_request")
    suffix = f" (request id {request_id})" if request_id else ""
    return ApiError(500, f"internal server error{suffix}", "internal_error")


# Request fields that are objects with fields of their own (no unions), whose errors name the inner field.
OBJECT_FIELDS = frozenset({"moe", "stream_options"})


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """pydantic's first error as one message naming the top-level field."""
    error = errors[0]
    location = [str(part) for part in error.get("loc", ())]
    if location[:1] in (["body"], ["query"], ["path"]):  # where FastAPI found it, not the field's name
        location = location[1:]
    param = location[0] if location else None  # the top-level field (deeper parts name union members)
    if param in OBJECT_FIELDS and len(location) > 1:
        param = f"{param}.{location[1]}"  # an object of named fields: name the one at fault (`moe.p`)
    if error.get("type") == "json_invalid":
        return f"malformed JSON in the request body: {error.get('msg', '')}", None
    if error.get("type") == "missing":
        return f"{param} is required", param
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")  # the validators' own words
    if param and message.startswith(f"{param}["):  # it names the place itself (`prompt[1][3] is null`)
        return message, param
    return (f"{param}: {message}" if param else message), param
