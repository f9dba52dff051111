"""`topk_uniform`: top-k by logit, each chosen expert weighted exactly 1/k (MOESART's inference path)."""

from __future__ import annotations

from moe_serve.kernels.vocabulary import Weighting
from moe_serve.layers.routers.base import Router
from moe_serve.router_registry import register


@register("topk_uniform")
class TopKUniform(Router):
    weighting = Weighting.UNIFORM
    top_p_defined = True
    onnx_graph = True
