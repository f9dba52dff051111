"""`sparsemixer`: Phi-3.5-MoE's router (SparseMixer, Liu et al. 2024) as transformers' `sparsemixer` computes it
in eval mode, where its Gumbel sampling becomes an argmax. Step i (i = 1 .. k) of a token with logits s:

    t_i   = the largest logit among the experts not chosen in steps 1 .. i-1; e_i its expert (ties: lower id)
    keep  = those experts j with (t_i - s_j) / max(|s_j|, t_i) <= 2 * jitter_eps   (relative distance from t_i)
    w_i   = softmax over `keep` of s, at e_i = 1 / sum_{j in keep} exp(s_j - t_i)

Each step's weight is its own masked softmax, so the weights are not renormalised over the k chosen (their sum
is not 1) and step i's weight does not depend on k.

What k means: k steps of this masked selection. The chosen experts are the top k by logit (step i takes the
i-th largest), each weighted as above. Phi-3.5-MoE runs exactly two steps whatever its num_experts_per_tok
(transformers ignores it), so k = 2 is the method; k = 1 stops after the first step (its weight, the first
step's masked softmax, is unchanged) and k up to N continues the same rule. Every k in 1..N is reachable, so
none is refused; any k other than the trained one (the model's default) is flagged approximate. A top-p policy
is not defined for the kind (it declares none), so such requests are refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_serve.config_schema import check_float
from moe_serve.kernels import ops
from moe_serve.kernels.vocabulary import RouteOutput, Weighting
from moe_serve.layers.routers.base import Router, RouterState
from moe_serve.router_registry import RouterConfig, register


@dataclass(frozen=True, slots=True)
class SparseMixerConfig(RouterConfig):
    # The relative distance from a step's top logit beyond which an expert leaves that step's softmax
    # (transformers' router_jitter_noise, which eval mode uses as this threshold; its default 0.01).
    jitter_eps: float = 0.01

    def __post_init__(self) -> None:
        RouterConfig.__post_init__(self)
        check_float("router jitter_eps", self.jitter_eps, 0.0, 1e6)

    def describe(self) -> str:
        return f"{self.kind} (jitter_eps={self.jitter_eps:g})"


@register("sparsemixer")
class SparseMixer(Router):
    Config = SparseMixerConfig
    onnx_graph = True  # plain torch ops on the logits alone

    def __init__(self, config: RouterConfig, num_experts: int) -> None:
        super().__init__(config, num_experts)
        assert isinstance(config, SparseMixerConfig)
        self.jitter_eps = config.jitter_eps

    def route(
        self, logits: torch.Tensor, token_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> RouteOutput:
        # The top k by logit, -1 beyond a row's k; the kernel's weights are not sparsemixer's (computed below).
        ids, _ = ops.topk_route(logits, token_k, max_k, Weighting.UNIFORM)  # [R, K]
        used = ids >= 0
        chosen = ids.clamp(min=0)
        experts = torch.arange(logits.shape[1], device=logits.device)
        taken = torch.zeros_like(logits, dtype=torch.bool)  # [R, N] experts chosen in earlier steps
        weights = []
        for step in range(max_k):
            expert = chosen[:, step : step + 1]  # [R, 1]
            # The same operations as transformers' eval-mode sparsemixer, so the masks agree bit for bit.
            top = logits.gather(1, expert)  # [R, 1]
            factor = torch.maximum(logits.abs(), top)
            far = ((top - logits) / factor) > (2 * self.jitter_eps)
            gates = torch.softmax(logits.masked_fill(taken | far, float("-inf")), dim=-1)
            weights.append(gates.gather(1, expert))
            taken = taken | (experts[None, :] == expert)
        weight = torch.cat(weights, dim=1)
        return RouteOutput(ids, torch.where(used, weight, torch.zeros_like(weight)))

    @classmethod
    def is_approximate(cls, k: int, num_experts: int, trained_k: int) -> bool:
        return k != trained_k

    def reference_weights(self, logits: list[float], chosen: list[int]) -> list[float]:
        weights = []
        for step, expert in enumerate(chosen):
            top = logits[expert]
            keep = [
                j
                for j, s in enumerate(logits)
                if j not in chosen[:step] and (top - s) / max(abs(s), top) <= 2 * self.jitter_eps
            ]
            weights.append(1.0 / sum(math.exp(logits[j] - top) for j in keep))
        return weights
