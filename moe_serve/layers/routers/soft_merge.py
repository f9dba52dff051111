"""`soft_merge` (SMEAR): one decision per input from its masked mean; the expert applied to every token is
the probability-weighted average of the chosen experts' parameters. k = N is exact SMEAR; k < N merges
the top-k experts with renormalised weights (an approximation, flagged in responses)."""

from __future__ import annotations

import torch

from moe_serve.layers.routers.base import Router, RouterState, register, top_experts


@register("soft_merge")
class SoftMerge(Router):
    per_sequence = True

    def route(
        self, logits: torch.Tensor, top_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        topk_logits, topk_ids, used = top_experts(logits, top_k, max_k)
        weights = torch.softmax(topk_logits.masked_fill(~used, float("-inf")), dim=-1)
        return topk_ids.masked_fill(~used, -1), weights

    @classmethod
    def is_approximate(cls, k: int, num_experts: int) -> bool:
        return k < num_experts
