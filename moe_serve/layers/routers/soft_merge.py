"""`soft_merge` (SMEAR): one decision per input from its masked mean; the expert applied to every token is
the probability-weighted average of the chosen experts' parameters. k = N is exact SMEAR; k < N merges
the top-k experts with renormalised weights (an approximation, flagged in responses). Top-p is not defined
for it: one decision per input, not per token, and SMEAR's exact method merges every expert."""

from __future__ import annotations

from moe_serve.kernels.vocabulary import Weighting
from moe_serve.layers.routers.base import PooledRouterConfig, Router
from moe_serve.router_registry import register


@register("soft_merge")
class SoftMerge(Router):
    Config = PooledRouterConfig
    weighting = Weighting.SOFTMAX_CHOSEN
    per_sequence = True
    merges_experts = True
    onnx_graph = True

    @classmethod
    def is_approximate(cls, k: int, num_experts: int, trained_k: int) -> bool:
        return k < num_experts
