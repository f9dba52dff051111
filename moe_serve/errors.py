"""Exceptions raised by the runtime. Each names what is wrong so callers can show it as is."""

from __future__ import annotations

from typing import Any


class MoEServeError(Exception):
    """Base class of every error the runtime raises on purpose."""


class ValidationError(MoEServeError, ValueError):
    """A per-call argument is invalid; `parameter` names it (maps to HTTP 400)."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


class ArtifactError(MoEServeError):
    """A serving artifact cannot be loaded: the message names the file, tensor or field."""


class ConfigError(ArtifactError, ValueError):
    """A model config field is missing or out of range."""


class ModelNotFoundError(MoEServeError):
    """A request names a model that is not served (HTTP 404)."""

    def __init__(self, name: str, available: list[str]) -> None:
        super().__init__(f"model '{name}' does not exist; served models: {', '.join(available)}")
        self.name = name


class NotFoundError(MoEServeError):
    """A request names a stored object (a file, a batch) that does not exist; `parameter` names the field
    that named it (HTTP 404)."""

    def __init__(self, message: str, *, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


class UnavailableError(MoEServeError):
    """A part of the server the request needs cannot serve it now, for a reason the message gives (HTTP 503)."""


class EngineOverloadedError(MoEServeError):
    """Too many requests are waiting; retry after `retry_after` seconds (HTTP 429)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NonFiniteError(MoEServeError):
    """A model's forward produced NaN or infinite values for a request (finite weights that overflow on its
    input): HTTP 422 naming the model; the request fails alone, the others in its step are unaffected."""


class EngineStoppedError(MoEServeError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class ClientDisconnectedError(MoEServeError):
    """The client went away before its response was ready (logged as 499)."""
