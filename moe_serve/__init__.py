"""moe-serve: serving runtime for Mixture-of-Experts models with per-request experts_per_token.

The public API is loaded on first use, so that importing a subpackage (the Shakespeare dataset of
`moe_serve.evaluation`, say) does not load the engine.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moe_serve.config import EngineConfig
    from moe_serve.llm import LLM
    from moe_serve.sampling_params import SamplingParams

_PUBLIC = {"LLM": "moe_serve.llm", "EngineConfig": "moe_serve.config", "SamplingParams": "moe_serve.sampling_params"}
__all__ = ["LLM", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'moe_serve' has no attribute {name!r}")
