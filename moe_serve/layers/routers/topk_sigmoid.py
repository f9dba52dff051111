"""`topk_sigmoid`: Llama 4's router. The top k experts by logit, each weighted by the sigmoid of its own logit
(not normalised: the weights need not sum to 1, and each one does not depend on k or on the other experts).
Llama 4 trains k = 1; a larger k adds the next experts by logit with their own sigmoids. Llama 4 applies the
weight to each chosen expert's input rather than its output (MoEConfig.weights_scale_input), which this kind
leaves to the MoE block. No top-p policy is defined for it (its weights are not a distribution)."""

from __future__ import annotations

import math

import torch

from moe_serve.kernels import ops
from moe_serve.kernels.vocabulary import RouteOutput, Weighting, sigmoid
from moe_serve.layers.routers.base import Router, RouterState
from moe_serve.router_registry import register


@register("topk_sigmoid")
class TopKSigmoid(Router):
    # No ONNX graph is claimed: its only model, Llama 4, is refused there for its attention, so no export of
    # this kind is proven against onnxruntime.
    onnx_graph = False

    def route(
        self, logits: torch.Tensor, token_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> RouteOutput:
        ids, _ = ops.topk_route(logits, token_k, max_k, Weighting.UNIFORM)  # the top k by logit, -1 beyond k
        weights = sigmoid(logits.float().gather(1, ids.clamp(min=0)))
        return RouteOutput(ids, torch.where(ids >= 0, weights, torch.zeros_like(weights)))

    def reference_weights(self, logits: list[float], chosen: list[int]) -> list[float]:
        return [1.0 / (1.0 + math.exp(-logits[e])) for e in chosen]
