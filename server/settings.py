"""Server settings: parsed once from the command line (options derived from these fields) and the
environment, and passed explicitly. The engine's and the requests' own settings are nested objects."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moe_serve.batch.core import MAX_IN_FLIGHT_TOKENS
from moe_serve.config import EngineConfig, RequestLimits
from moe_serve.errors import ValidationError
from moe_serve.options import option
from moe_serve.validation import check_int, check_number

ExpertMetrics = Literal["full", "summary", "off"]
EXPERT_METRICS = ("full", "summary", "off")
OPEN_PATHS = ("/health", "/ping", "/ready", "/version")  # answered without an API key (load balancers, probes)
MONITORING_PATHS = ("/metrics", "/dashboard", "/dashboard/data", "/docs", "/openapi.json")
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")  # vLLM's names, outside /v1
BATCH_API_PATHS = ("/v1/files", "/v1/batches")  # the Batch API: bookkeeping, no model work of its own
UPLOAD_PATHS = ("/v1/files",)  # bodies streamed to disk under max_upload_bytes, not read whole


def is_api_path(path: str) -> bool:
    """The paths that do model work: admitted, counted in metrics by route, documented with error statuses."""
    return path.startswith("/v1/") or path in TOKENIZER_PATHS


def is_interactive_path(path: str) -> bool:
    """The API paths whose requests a client waits on while a model works: what batches yield to."""
    return is_api_path(path) and not any(path == p or path.startswith(p + "/") for p in BATCH_API_PATHS)


def default_data_dir() -> Path:
    """Where the Batch API keeps its state by default: the XDG state dir (the user's, not a cache: losing it
    loses batches)."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "moe-serve"


@dataclass(frozen=True, slots=True)
class ServerSettings:
    models: tuple[str, ...] = option((), "artifact directories or bundled names (none: every bundled demo)", cli=False)
    served_model_name: tuple[str, ...] = option(
        (),
        "the names the model is served under, as vLLM's: a request may give any, responses, /v1/models and the "
        "metrics report the first (default: the artifact's name; one model only)",
        nargs="+",
        metavar="NAME",
    )
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    api_key: str | None = option(None, "the API key (visible in `ps`: prefer --api-key-file or MOE_SERVE_API_KEY)")
    api_key_file: str | None = option(None, "read the API key from this file (or MOE_SERVE_API_KEY_FILE)")
    allow_unauthenticated: bool = option(
        False, "listen on a non-loopback address without an API key (refused otherwise)"
    )
    max_body_bytes: int = option(1 << 20, "larger request bodies get 413")
    max_upload_bytes: int = option(
        200 << 20,
        "larger files uploaded to POST /v1/files get 413 (written into --data-dir as they arrive, never held in "
        "memory nor spooled to the system temp dir)",
    )
    data_dir: str | None = option(
        None, "the Batch API's database and files (default: $XDG_STATE_HOME/moe-serve, else ~/.local/state/moe-serve)"
    )
    max_stored_bytes: int = option(
        10 << 30,
        "quota for every byte kept in --data-dir (uploads, batch outputs, the answers of running batches): an upload "
        "that would pass it gets 507, a batch that would waits until files are deleted",
    )
    batch_max_in_flight: int = option(
        64, "Batch API lines in flight while no interactive request runs (one while any does)"
    )
    batch_max_in_flight_tokens: int = option(
        MAX_IN_FLIGHT_TOKENS,
        "prompt tokens of the Batch API lines in flight while no interactive request runs (an eighth while any "
        "does); a line larger than this runs alone",
    )
    public_monitoring: bool = option(
        False, "with an API key, still serve /metrics, /dashboard, /docs and /openapi.json without it"
    )
    max_concurrent_requests: int = option(512, "API requests handled at once; more get 503 with Retry-After")
    max_connections: int = option(1024, "open connections at once; more get 503 with Retry-After in the error envelope")
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

    def _check_served_names(self) -> None:
        names = self.served_model_name
        if not names:
            return
        if len(self.models) != 1:
            served = f"{len(self.models)} models are" if self.models else "no MODEL is given (every bundled demo is)"
            raise ValidationError(
                f"--served-model-name names one model, but {served} served: give one MODEL with it",
                parameter="served_model_name",
            )
        for name in names:
            if not name.strip() or name != name.strip():
                raise ValidationError(f"--served-model-name {name!r} is not a name", parameter="served_model_name")
        if len(set(names)) != len(names):
            raise ValidationError(f"--served-model-name names {list(names)} repeat", parameter="served_model_name")

    @property
    def batch_data_dir(self) -> Path:
        return Path(self.data_dir).expanduser() if self.data_dir else default_data_dir()

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
        object.__setattr__(self, "served_model_name", tuple(self.served_model_name))
        self._check_served_names()
        check_int("port", self.port, 0, 65535)
        check_int("batch_max_in_flight", self.batch_max_in_flight, 1)
        check_int("batch_max_in_flight_tokens", self.batch_max_in_flight_tokens, 1)
        check_int("max_stored_bytes", self.max_stored_bytes, 1)
        for name in ("max_body_bytes", "max_upload_bytes", "max_concurrent_requests", "max_connections"):
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
