"""moe-serve: serving runtime for Mixture-of-Experts models with per-request experts_per_token."""

from moe_serve.config import EngineConfig
from moe_serve.llm import LLM
from moe_serve.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"
