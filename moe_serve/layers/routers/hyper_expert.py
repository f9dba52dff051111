"""`hyper_expert`: HyperMoE (Zhao et al. 2024; method card hypermoe.md §8, binding). Routing is top-k by
router logit, weighted as `topk_softmax` with the checkpoint's normalisation (Switch: the chosen expert's
full-softmax probability, not renormalised); the MoE block then adds, ungated, the HyperExpert adapter of
the token's selected set (MoEConfig.hyper_expert, precomputed by the exporter from the hypernetwork).
Only the trained k is served: the adapters are keyed by the selected set of that k (the config enforces it).
"""

from __future__ import annotations

import itertools
import math

import torch

from moe_serve.kernels import ops
from moe_serve.layers.routers.base import Router, RouterState, register


@register("hyper_expert")
class HyperExpert(Router):
    def route(
        self, logits: torch.Tensor, top_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.topk_route(logits, top_k, max_k, "softmax_chosen" if self.config.normalize else "softmax_all")


def selected_sets(num_experts: int, k: int) -> list[tuple[int, ...]]:
    """The C(N, k) selected sets in adapter-table order (pattern_index of each is its position)."""
    return sorted(itertools.combinations(range(num_experts), k), key=lambda s: s[::-1])  # colexicographic


def pattern_index(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """topk_ids [T, k] (the k experts of each token, any order) -> [T] the rank of the set in colexicographic
    order (the combinatorial number system; selected_sets lists them); for k = 1, the expert itself.
    A row of -1 (padding, no experts) gives -1."""
    k = topk_ids.shape[1]
    if k == 1:
        return topk_ids[:, 0]
    ids = topk_ids.sort(dim=1).values
    # rank = sum_i C(c_i, i + 1) over the ascending ids c_0 < c_1 < ...: a bijection onto 0 .. C(N, k) - 1.
    table = torch.tensor(
        [[math.comb(c, i + 1) for i in range(k)] for c in range(num_experts)], dtype=torch.int64, device=ids.device
    )
    rank = table[ids.clamp(min=0), torch.arange(k, device=ids.device)].sum(1)
    return torch.where(ids[:, 0] < 0, torch.full_like(rank, -1), rank)
