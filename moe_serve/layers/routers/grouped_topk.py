"""`grouped_topk`: DeepSeek's routers (V2, V3; GLM-4.5 routes as V3), as transformers computes them in eval mode.
For a token with router logits s over N experts in `groups` equal groups:

    p       = sigmoid(s) (V3) or softmax(s) (V2)                          the scores that weigh experts
    c       = p + b (b: the layer's correction bias, V3) or p             the scores that choose them
    g_j     = the sum of the two largest c in group j (V3), or their max (V2's group_limited_greedy)
    kept    = the `groups_kept` groups of largest g (ties: lower group)
    chosen  = the k largest c among the experts of the kept groups (ties: lower expert)
    w_e     = p_e, divided by the sum of the chosen p (+ 1e-20) when `normalize`, times `scale`

The correction bias b (DeepSeek-V3's e_score_correction_bias, a per-layer tensor stored as
`moe.router.correction_bias` in fp32 beside the router weight) moves which experts are chosen, never their
weights. `scale` is the routed_scaling_factor, applied to the routed experts' weights only (the shared experts
are added unscaled). V2's `greedy` is the same rule with one group.

What k means: k is the final number of routed experts. The groups kept stay as trained (`groups_kept` of
`groups`, whatever k is), so k ranges over 1 .. groups_kept * (N / groups); a model whose k range goes past
that is refused at load, and a request for such a k is refused naming the group limit (`max_k_reason`).
Every k in that range follows the same rule, so none is flagged approximate (as for `topk_softmax`). A top-p
policy is not defined for the kind: the experts are not chosen in order of the router's softmax probability
(sigmoid scores, the bias, the group limit), so such requests are refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from moe_serve.config_schema import check_choice, check_float, check_size
from moe_serve.errors import ConfigError
from moe_serve.kernels.vocabulary import RouteOutput, sigmoid
from moe_serve.layers.routers.base import Router, RouterState
from moe_serve.router_registry import RouterConfig, register

if TYPE_CHECKING:
    from moe_serve.model_config import MoEConfig

ScoreFunction = Literal["sigmoid", "softmax"]
GroupScore = Literal["top2_sum", "max"]
MAX_GROUPS = 4096  # as MAX_EXPERTS: a group holds at least one expert
NORMALIZE_EPS = 1e-20  # transformers' (and DeepSeek's) guard in the normalising sum


@dataclass(frozen=True, slots=True)
class GroupedTopKConfig(RouterConfig):
    score: ScoreFunction = "sigmoid"  # the scores that weigh the chosen experts
    groups: int = 1  # the experts in this many equal groups, by index
    groups_kept: int = 1  # the groups a token may choose from (topk_group)
    group_score: GroupScore = "top2_sum"  # how a group ranks: its two best scores summed (V3) or its best (V2)
    correction_bias: bool = False  # a per-layer bias added to the scores for choosing only (V3)
    normalize: bool = False  # the chosen weights divided by their sum (norm_topk_prob)
    scale: float = 1.0  # routed_scaling_factor

    def __post_init__(self) -> None:
        RouterConfig.__post_init__(self)
        check_choice("router score", self.score, ScoreFunction)
        check_choice("router group_score", self.group_score, GroupScore)
        check_size("router groups", self.groups, MAX_GROUPS)
        check_size("router groups_kept", self.groups_kept, MAX_GROUPS)
        if self.groups_kept > self.groups:
            raise ConfigError(f"router groups_kept ({self.groups_kept}) must not exceed groups ({self.groups})")
        check_float("router scale", self.scale, 0.0, 1e6, low_open=True)

    def describe(self) -> str:
        parts: list[str] = [self.score]
        if self.groups_kept < self.groups:
            parts.append(f"{self.groups_kept} of {self.groups} groups by {self.group_score}")
        if self.correction_bias:
            parts.append("correction bias")
        if self.normalize:
            parts.append("normalized")
        if self.scale != 1.0:
            parts.append(f"scale={self.scale:g}")
        return f"{self.kind} ({', '.join(parts)})"


@register("grouped_topk")
class GroupedTopK(Router):
    Config = GroupedTopKConfig

    def __init__(self, config: RouterConfig, num_experts: int) -> None:
        super().__init__(config, num_experts)
        assert isinstance(config, GroupedTopKConfig)
        self.settings = config
        self.bias: torch.Tensor | None = None  # [N] fp32, bound by the MoE block (bind) when correction_bias

    @classmethod
    def tensor_shapes(cls, config: RouterConfig, num_experts: int) -> dict[str, tuple[int, ...]]:
        assert isinstance(config, GroupedTopKConfig)
        return {"correction_bias": (num_experts,)} if config.correction_bias else {}

    def bind(self, tensors: dict[str, torch.Tensor]) -> None:
        self.bias = tensors.get("correction_bias")

    def route(
        self, logits: torch.Tensor, token_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> RouteOutput:
        s = self.settings
        rows, n = logits.shape
        scores = sigmoid(logits) if s.score == "sigmoid" else torch.softmax(logits, dim=-1)  # [R, N]
        choice = scores
        if s.correction_bias:
            assert self.bias is not None, "the MoE block binds the correction bias before routing (MoEBlock.prepare)"
            choice = scores + self.bias
        if s.groups_kept < s.groups:
            grouped = choice.view(rows, s.groups, n // s.groups)  # [R, G, N/G]
            if s.group_score == "max":
                group_scores = grouped.max(dim=-1).values
            else:  # the two largest summed, as transformers' topk(2).sum
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [R, G]
            kept = torch.sort(group_scores, dim=-1, descending=True, stable=True)[1][:, : s.groups_kept]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, kept, True)  # [R, G]
            choice = choice.masked_fill(~keep.repeat_interleave(n // s.groups, dim=1), float("-inf"))
        ids = torch.sort(choice, dim=-1, descending=True, stable=True)[1][:, :max_k]  # [R, K]
        used = torch.arange(max_k, device=logits.device)[None, :] < token_k[:, None]  # [R, K]
        weights = torch.where(used, scores.gather(1, ids), torch.zeros((), device=logits.device))
        if s.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + NORMALIZE_EPS)
        if s.scale != 1.0:
            weights = weights * s.scale
        return RouteOutput(ids.masked_fill(~used, -1), weights)

    @classmethod
    def reachable_k(cls, config: GroupedTopKConfig, num_experts: int) -> int:
        """The most experts a token can be routed to: every expert of the groups kept."""
        return config.groups_kept * (num_experts // config.groups)

    @classmethod
    def max_k_reason(cls, moe: MoEConfig) -> str | None:
        config = moe.router
        assert isinstance(config, GroupedTopKConfig)
        if config.groups_kept == config.groups or moe.max_k < cls.reachable_k(config, moe.num_experts):
            return None  # the model's own experts_per_token.max is the tighter bound
        return (
            f"router kind {cls.kind} keeps {config.groups_kept} of its {config.groups} expert groups "
            f"({moe.num_experts // config.groups} experts each) as trained, so a token reaches at most "
            f"{cls.reachable_k(config, moe.num_experts)} experts"
        )

    @classmethod
    def check_moe(cls, moe: MoEConfig) -> None:
        super().check_moe(moe)
        config = moe.router
        assert isinstance(config, GroupedTopKConfig)
        if moe.num_experts % config.groups:
            raise ConfigError(
                f"router kind {cls.kind}: num_experts ({moe.num_experts}) must split into {config.groups} equal groups"
            )
        ranked = config.groups_kept < config.groups  # groups are ranked only when some are dropped
        if ranked and config.group_score == "top2_sum" and moe.num_experts < 2 * config.groups:
            raise ConfigError(
                f"router kind {cls.kind}: group_score top2_sum needs at least two experts per group; "
                f"{moe.num_experts} experts in {config.groups} groups have {moe.num_experts // config.groups}"
            )
        reachable = cls.reachable_k(config, moe.num_experts)
        if moe.max_k > reachable:
            raise ConfigError(f"experts_per_token.max ({moe.max_k}) is beyond the group limit: {cls.max_k_reason(moe)}")

    # ---- the slow reference -------------------------------------------------------------------------

    def reference_route(
        self, logits: list[float], k: int, bias: list[float] | None = None
    ) -> tuple[list[int], list[float]]:
        """One token in plain Python (the module docstring written out): its k experts, best first, and weights."""
        s, n = self.settings, len(logits)
        if s.score == "sigmoid":
            p = [1.0 / (1.0 + math.exp(-v)) for v in logits]
        else:
            peak = max(logits)
            z = sum(math.exp(v - peak) for v in logits)
            p = [math.exp(v - peak) / z for v in logits]
        c = [p[e] + (bias[e] if bias is not None else 0.0) for e in range(n)]
        size = n // s.groups
        members = [range(j * size, (j + 1) * size) for j in range(s.groups)]
        if s.group_score == "max":
            ranked = [max(c[e] for e in group) for group in members]
        else:
            ranked = [sum(sorted((c[e] for e in group), reverse=True)[:2]) for group in members]
        kept = sorted(range(s.groups), key=lambda j: (-ranked[j], j))[: s.groups_kept]
        pool = [e for j in sorted(kept) for e in members[j]]
        chosen = sorted(pool, key=lambda e: (-c[e], e))[:k]
        weights = [p[e] for e in chosen]
        if s.normalize:
            total = sum(weights) + NORMALIZE_EPS
            weights = [w / total for w in weights]
        return chosen, [w * s.scale for w in weights]
