"""Model code: one configurable MoE transformer covers every architecture an artifact can describe."""

from moe_serve.models.transformer import MoETransformer

__all__ = ["MoETransformer"]
