"""Server settings: parsed once from the command line (options derived from these fields) and the
environment, and passed explicitly. The engine's and the requests' own settings are nested objects."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moe_serve.config import EngineConfig, RequestLimits
from moe_serve.errors import ValidationError
from moe_serve.options import option
from moe_serve.validation import check_int, check_number

ExpertMetrics = Literal["full", "summary", "off"]
EXPERT_METRICS = ("full", "summary", "off")
OPEN_PATHS = ("/health", "/ready")  # answered without an API key (load balancers, orchestrators)
MONITORING_PATHS = ("/metrics", "/dashboard", "/dashboard/data", "/docs", "/openapi.json")
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")  # vLLM's names, outside /v1


def is_api_path(path: str) -> bool:
    """The paths that do model work: admitted, counted in metrics by route, documented with error statuses."""
    return path.startswith("/v1/") or path in TOKENIZER_PATHS


@dataclass(frozen=True, slots=True)
class ServerSettings:
    models: tuple[str, ...] = option((), "artifact directories or bundled names (none: every bundled demo)", cli=False)
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    api_key: str | None = option(None, "the API key (visible in `ps`: prefer --api-key-file or MOE_SERVE_API_KEY)")
    api_key_file: str | None = option(None, "read the API key from this file (or MOE_SERVE_API_KEY_FILE)")
    allow_unauthenticated: bool = option(
        False, "listen on a non-loopback address without an API key (refused otherwise)"
    )
    max_body_bytes: int = option(1 << 20, "larger request bodies get 413")
    public_monitoring: bool = option(
        False, "with an API key, still serve /metrics, /dashboard, /docs and /openapi.json without it"
    )
    max_concurrent_requests: int = option(512, "API requests handled at once; more get 503 with Retry-After")
    max_connections: int = option(1024, "open connections at once; more are answered 503 by uvicorn")
    header_timeout: float = option(10.0, "seconds a connection may take to send a request's headers")
    keep_alive_timeout: float = option(5.0, "seconds an idle keep-alive connection stays open")
    expert_metrics: ExpertMetrics = option(
        "full",
        "per-expert counters (full), bounded per-layer summaries (summary) or none (off)",
        choices=EXPERT_METRICS,
    )
    drain_timeout: float = option(30.0, "seconds SIGTERM lets in-flight requests finish (new ones get 503)")
    log_level: str = option("info", "debug, info, warning or error")
    engine: EngineConfig = option(factory=EngineConfig, cli=False)
    limits: RequestLimits = option(factory=RequestLimits, cli=False)

    @property
    def open_paths(self) -> tuple[str, ...]:
        """What is served without the API key."""
        return OPEN_PATHS + MONITORING_PATHS if self.public_monitoring else OPEN_PATHS

    def __post_init__(self) -> None:
        key = self.api_key or os.environ.get("MOE_SERVE_API_KEY") or None
        key_file = self.api_key_file or (None if key else os.environ.get("MOE_SERVE_API_KEY_FILE"))
        if key_file:
            key = _read_key(key_file)
        object.__setattr__(self, "api_key", key)
        check_int("port", self.port, 0, 65535)
        for name in ("max_body_bytes", "max_concurrent_requests", "max_connections"):
            check_int(name, getattr(self, name), 1)
        for name in ("header_timeout", "keep_alive_timeout", "drain_timeout"):
            check_number(name, getattr(self, name), 0.1, 3600.0)
        if key is None and not self.allow_unauthenticated and not _is_loopback(self.host):
            raise ValidationError(
                f"listening on {self.host} without an API key would open the server to the network: give "
                "--api-key-file (or MOE_SERVE_API_KEY), or --allow-unauthenticated",
                parameter="api_key",
            )


def _read_key(path: str) -> str:
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationError(f"cannot read the API key file {path}: {exc}", parameter="api_key_file") from None
    if not key:
        raise ValidationError(f"the API key file {path} is empty", parameter="api_key_file")
    return key


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
