"""Server settings: parsed once from the command line / environment and passed explicitly."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

ExpertMetrics = Literal["full", "summary", "off"]


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Args:
    models: artifact directories or bundled names (empty: every bundled demo model).
    api_key: when set, /v1/* needs `Authorization: Bearer <key>` (env MOE_SERVE_API_KEY).
    max_tokens_cap: the largest max_tokens a request may ask for.
    max_body_bytes: larger request bodies get 413.
    max_waiting: queued requests per model beyond which new ones get 429.
    expert_metrics: per-expert counters ("full"), bounded per-layer summaries ("summary"), or none.
    drain_timeout: seconds SIGTERM waits for in-flight requests.
    """

    models: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default_factory=lambda: os.environ.get("MOE_SERVE_API_KEY") or None)
    max_tokens_cap: int = 4096
    max_body_bytes: int = 1 << 20
    max_waiting: int = 256
    max_num_seqs: int = 32
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    device: str = "auto"
    expert_metrics: ExpertMetrics = "full"
    drain_timeout: float = 30.0
