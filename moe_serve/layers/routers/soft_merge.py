"""`soft_merge` (SMEAR): one decision per input from its masked mean; the expert applied to every token is
the probability-weighted average of the chosen experts' parameters. k = N is exact SMEAR; k < N merges
the top-k experts with renormalised weights (an approximation, flagged in responses). Top-p is not defined
for it: one decision per input, not per token, and SMEAR's exact method merges every expert."""

from __future__ import annotations

import torch

from moe_serve.kernels import ops
from moe_serve.layers.routers.base import Router, RouterState, register


@register("soft_merge")
class SoftMerge(Router):
    per_sequence = True
    merges_experts = True

    def route(
        self, logits: torch.Tensor, top_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.topk_route(logits, top_k, max_k, "softmax_chosen")

    @classmethod
    def is_approximate(cls, k: int, num_experts: int, trained_k: int) -> bool:
        return k < num_experts
