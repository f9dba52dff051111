"""Server settings: parsed once from the command line (options derived from these fields) and the
environment, and passed explicitly. The engine's and the requests' own settings are nested objects."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from moe_serve.config import EngineConfig, RequestLimits
from moe_serve.options import option

ExpertMetrics = Literal["full", "summary", "off"]
EXPERT_METRICS = ("full", "summary", "off")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    models: tuple[str, ...] = option((), "artifact directories or bundled names (none: every bundled demo)", cli=False)
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    api_key: str | None = option(
        None, "require Authorization: Bearer KEY on /v1/* (default: the environment variable MOE_SERVE_API_KEY)"
    )
    max_body_bytes: int = option(1 << 20, "larger request bodies get 413")
    expert_metrics: ExpertMetrics = option(
        "full",
        "per-expert counters (full), bounded per-layer summaries (summary) or none (off)",
        choices=EXPERT_METRICS,
    )
    drain_timeout: float = option(30.0, "seconds SIGTERM waits for in-flight requests")
    log_level: str = option("info", "debug, info, warning or error")
    engine: EngineConfig = option(factory=EngineConfig, cli=False)
    limits: RequestLimits = option(factory=RequestLimits, cli=False)

    def __post_init__(self) -> None:
        if self.api_key is None and os.environ.get("MOE_SERVE_API_KEY"):
            object.__setattr__(self, "api_key", os.environ["MOE_SERVE_API_KEY"])
