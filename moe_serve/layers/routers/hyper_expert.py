"""`hyper_expert`: HyperMoE (Zhao et al. 2024; method card hypermoe.md §8, binding). Routing is top-k by
router logit, weighted as `topk_softmax` with the checkpoint's normalisation (the released code: Switch at
k = 1, the chosen expert's full-softmax probability, not renormalised; GPT-2 at k > 1, the chosen
probabilities renormalised to sum to 1); the MoE block then adds, ungated, the HyperExpert adapter of
the token's selected set (MoEConfig.hyper_expert, precomputed by the exporter from the hypernetwork).
Only the trained k is served: the adapters are keyed by the selected set of that k (the config enforces it).
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import torch

from moe_serve.errors import ConfigError
from moe_serve.layers.routers.topk_softmax import TopKSoftmax
from moe_serve.router_registry import register

if TYPE_CHECKING:
    from moe_serve.model_config import MoEConfig


@register("hyper_expert")
class HyperExpert(TopKSoftmax):
    """Top-k by logit weighted as topk_softmax (its `normalize` setting); the block adds the adapters."""

    top_p_defined = False  # the adapters are keyed by the selected set of the trained k

    @classmethod
    def check_moe(cls, moe: MoEConfig) -> None:
        if moe.hyper_expert is None:
            raise ConfigError("router kind hyper_expert needs moe.hyper_expert (the HyperMoE adapters)")
        if moe.hyper_expert.kind != "adapter":
            raise ConfigError(f"moe.hyper_expert must be an adapter FFN; got kind {moe.hyper_expert.kind!r}")
        if not moe.min_k == moe.default_k == moe.max_k:
            raise ConfigError(
                "a hyper_expert model serves only its trained k (its adapters are keyed by the selected set): "
                f"experts_per_token min, default and max must be equal; got {moe.min_k}, {moe.default_k}, {moe.max_k}"
            )


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
