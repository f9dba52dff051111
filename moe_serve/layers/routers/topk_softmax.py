"""`topk_softmax`: top-k by logit. normalize=true: softmax over the chosen logits (Mixtral, HyperRouter,
SMoE); normalize=false: the chosen experts' full-softmax probabilities, whose sum shrinks with k
(Qwen2-MoE, OLMoE)."""

from __future__ import annotations

import torch

from moe_serve.layers.routers.base import Router, RouterState, register, top_experts


@register("topk_softmax")
class TopKSoftmax(Router):
    def route(
        self, logits: torch.Tensor, top_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        topk_logits, topk_ids, used = top_experts(logits, top_k, max_k)
        if self.config.normalize:
            weights = torch.softmax(topk_logits.masked_fill(~used, float("-inf")), dim=-1)
        else:
            weights = torch.softmax(logits, dim=-1).gather(1, topk_ids) * used
        return topk_ids.masked_fill(~used, -1), weights
