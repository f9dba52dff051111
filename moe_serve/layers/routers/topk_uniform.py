"""`topk_uniform`: top-k by logit, each chosen expert weighted exactly 1/k (MOESART's inference path)."""

from __future__ import annotations

import torch

from moe_serve.layers.routers.base import Router, RouterState, register, top_experts


@register("topk_uniform")
class TopKUniform(Router):
    def route(
        self, logits: torch.Tensor, top_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _, topk_ids, used = top_experts(logits, top_k, max_k)
        return topk_ids.masked_fill(~used, -1), used.float() / top_k[:, None].float()
