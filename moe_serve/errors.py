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
