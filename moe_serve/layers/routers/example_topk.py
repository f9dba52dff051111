"""`example_topk`: one decision per input from its masked mean (as soft_merge), then the top-k experts
each applied to every token of the input, not merged, weighted by their full-softmax probability (not
renormalised). At k = 1 this is SMEAR's "Top-k" baseline (code `switch_routing`): the argmax expert's
output scaled by p_max. Top-p is not defined for it (one decision per input)."""

from __future__ import annotations

import torch

from moe_serve.kernels import ops
from moe_serve.layers.routers.base import Router, RouterState, register


@register("example_topk")
class ExampleTopK(Router):
    per_sequence = True
    merges_experts = False

    def route(
        self, logits: torch.Tensor, top_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.topk_route(logits, top_k, max_k, "softmax_all")
