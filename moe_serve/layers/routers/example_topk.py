"""`example_topk`: one decision per input from its masked mean (as soft_merge), then the top-k experts
each applied to every token of the input, not merged, weighted by their full-softmax probability (not
renormalised). At k = 1 this is SMEAR's "Top-k" baseline (code `switch_routing`): the argmax expert's
output scaled by p_max. Top-p is not defined for it (one decision per input)."""

from __future__ import annotations

from moe_serve.kernels.vocabulary import Weighting
from moe_serve.layers.routers.base import PooledRouterConfig, Router
from moe_serve.router_registry import register


@register("example_topk")
class ExampleTopK(Router):
    Config = PooledRouterConfig
    weighting = Weighting.SOFTMAX_ALL
    per_sequence = True
    merges_experts = False
    onnx_graph = True
