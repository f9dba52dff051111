"""The OpenAPI document as the server behaves: no 422 (validation errors are 400s in the error envelope),
the error statuses each API route can answer (all in the one envelope), and the streaming endpoints'
text/event-stream responses. Field ranges come from the request models themselves."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from moe_serve.server.settings import is_api_path

STREAMING = ("/v1/completions", "/v1/chat/completions")
ERROR_STATUSES = {
    "400": "invalid request (the error names the parameter)",
    "401": "missing or invalid API key (when the server has one)",
    "404": "unknown model (or file, or batch)",
    "413": "request body too large",
    "429": "queue full: retry after Retry-After seconds",
    "503": "draining or at its request limit: retry after Retry-After seconds",
    "500": "internal error (the message carries only the request id)",
}
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"type": "integer"},
            },
        }
    },
}


def clean_openapi(app: FastAPI) -> None:
    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, operations in schema.get("paths", {}).items():
                for method, operation in operations.items():
                    operation.get("responses", {}).pop("422", None)
                    if is_api_path(path):
                        named = "{" in path or path == "/tokenizer_info"  # a GET that names a model
                        codes = ("400", "401", "404", "503") if named else ("401", "503")
                        statuses = ERROR_STATUSES if method == "post" else {c: ERROR_STATUSES[c] for c in codes}
                        for code, description in statuses.items():
                            operation["responses"][code] = {
                                "description": description,
                                "content": {
                                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
                                },
                            }
                    if path in STREAMING:
                        ok = operation["responses"].setdefault("200", {"description": "Successful Response"})
                        ok.setdefault("content", {})["text/event-stream"] = {
                            "schema": {"type": "string", "description": "server-sent events, ending with data: [DONE]"}
                        }
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            schemas["ErrorResponse"] = ERROR_SCHEMA
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
