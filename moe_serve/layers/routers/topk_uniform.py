"""`topk_uniform`: top-k by logit, each chosen expert weighted exactly 1/k (MOESART's inference path)."""

from __future__ import annotations

import torch

from moe_serve.kernels import ops
from moe_serve.layers.routers.base import Router, RouterState, register


@register("topk_uniform")
class TopKUniform(Router):
    top_p_defined = True

    def route(
        self, logits: torch.Tensor, top_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.topk_route(logits, top_k, max_k, "uniform")
