"""`topk_softmax`: top-k by logit. normalize=true: softmax over the chosen logits (Mixtral, HyperRouter,
SMoE); normalize=false: the chosen experts' full-softmax probabilities, whose sum shrinks with k
(Qwen2-MoE, OLMoE)."""

from __future__ import annotations

import torch

from moe_serve.kernels import ops
from moe_serve.layers.routers.base import Router, RouterState, register


@register("topk_softmax")
class TopKSoftmax(Router):
    top_p_defined = True

    def route(
        self, logits: torch.Tensor, top_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.topk_route(logits, top_k, max_k, "softmax_chosen" if self.config.normalize else "softmax_all")
