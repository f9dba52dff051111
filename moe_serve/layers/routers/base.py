"""The router-kind interface (docs/architecture.md §3): `Router`, a kind's rules (moe_serve.router_registry's
`RouterKind`) plus its routing.

A router kind is one module with one `Router` subclass, registered by name, that owns everything about the
kind:
- its settings: `Router.Config`, a frozen dataclass extending RouterConfig, whose fields sit flat in
  config.json's `moe.router` and are checked by its own `__post_init__`;
- its weighting: `Router.weighting`, data (kernels.vocabulary.Weighting) that the kernels consume;
- its model-level checks (`check_moe`, `check_model`), whether the ONNX graph can express it
  (`onnx_refusal`), which k it defines exactly (`is_approximate`);
- its slow reference (`reference_weights`, `reference_scores`), which the tests compare the fast path with.

route(logits [R, N] fp32, token_k [R], max_k, state) -> RouteOutput(topk_ids [R, K], topk_weights [R, K]):
R rows (tokens, or sequences for a per-sequence kind), N experts, K = max_k slots; slots beyond a row's
own k get id -1 and weight 0 and are never computed. Ties go to the lower expert index; no noise, no
capacity limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_serve.config_schema import check_choice
from moe_serve.kernels import ops
from moe_serve.kernels.vocabulary import AttentionBatch, RouteOutput, Weighting
from moe_serve.layers.batch import AttentionInputs
from moe_serve.model_config import NormKind
from moe_serve.router_registry import RouterConfig, RouterKind, router_class


@dataclass(frozen=True, slots=True)
class PooledRouterConfig(RouterConfig):
    """The settings of a per-sequence kind (Router.per_sequence): it routes the masked mean of the input's
    MoE-layer inputs, normed first when input_norm is set (SMEAR's LN_in)."""

    input_norm: NormKind | None = None

    def __post_init__(self) -> None:
        RouterConfig.__post_init__(self)
        if self.input_norm is not None:
            check_choice("router input_norm", self.input_norm, NormKind)


@dataclass(frozen=True, slots=True)
class RouterState:
    """What a stateful router reads besides the logits: the step's tokens (their MoE-layer inputs and where
    each sits in its sequence) and its per-token memory in one MoE layer. Row `slot` of `cache` belongs to
    the token the KV cache keeps at that slot, so the state follows chunked prefill, prefix caching and
    preemption. Without a cache (classify, whole sequences), every sequence is whole in the step."""

    cache: torch.Tensor | None  # [NB * BS, state_size] fp32
    batch: AttentionBatch  # the step's tokens: sequences, positions, block tables, slot mapping
    block_size: int
    inputs: torch.Tensor  # [T, D] the MoE layer's input of each token of the step
    attention: AttentionInputs | None = None  # the same layer's attention (kinds with reads_attention)
    moe_layer: int = 0  # this block's position in moe.layers (per-layer router settings are in that order)

    def rows_of(self, seq: int, num_tokens: int) -> torch.Tensor:
        """The state rows of a sequence's first num_tokens tokens, in order: [num_tokens] int64."""
        assert self.cache is not None and self.batch.block_tables is not None
        positions = torch.arange(num_tokens, device=self.cache.device)
        table = self.batch.block_tables[seq].long()
        return table[positions // self.block_size] * self.block_size + positions % self.block_size


class Router(RouterKind):
    """A registered kind's routing: its rules (RouterKind) and how it turns logits into each row's experts."""

    # How the chosen experts are weighted (a kind may set it per config).
    weighting: Weighting = Weighting.SOFTMAX_CHOSEN

    def __init__(self, config: RouterConfig, num_experts: int) -> None:
        self.config = config
        self.num_experts = num_experts

    # ---- serving ------------------------------------------------------------------------------------

    def route(
        self, logits: torch.Tensor, token_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> RouteOutput:
        """-> topk_ids [R, K] (-1 beyond a row's k), topk_weights [R, K] fp32. By default the top-k logits,
        weighted by the kind's weighting; a kind that reads more than the logits overrides this."""
        return ops.topk_route(logits, token_k, max_k, self.weighting)

    def bind(self, tensors: dict[str, torch.Tensor]) -> None:
        """Receive the tensors of `tensor_shapes` (fp32), from MoEBlock.prepare after loading."""

    # ---- the slow reference the tests compare with ------------------------------------------------

    def reference_scores(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        """One whole sequence, float64: x [n, D] its MoE-layer inputs, logits [n, N] -> the scores each token's
        top-k is taken from, if not its logits (then weighted as q[e] / sum of the chosen q); None: route by
        the logits and the weighting."""
        return None

    def reference_weights(self, logits: list[float], chosen: list[int]) -> list[float]:
        """The combine weights of the chosen experts (largest logit first), one token at a time in plain
        Python: the weighting written out, independent of the kernels."""
        if self.weighting is Weighting.UNIFORM:
            return [1.0 / len(chosen)] * len(chosen)
        peak = max(logits)
        pool = range(len(logits)) if self.weighting is Weighting.SOFTMAX_ALL else chosen
        z = sum(math.exp(logits[i] - peak) for i in pool)
        return [math.exp(logits[i] - peak) / z for i in chosen]


def make_router(config: RouterConfig, num_experts: int) -> Router:
    """The Router of config's kind, for a layer of num_experts experts."""
    cls = router_class(config.kind)
    if not issubclass(cls, Router):
        raise TypeError(f"router kind {config.kind} is registered as {cls.__name__}, not a Router subclass")
    return cls(config, num_experts)
