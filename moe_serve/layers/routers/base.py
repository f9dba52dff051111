"""The router interface and its registry.

route(logits [R, N] fp32, top_k [R], max_k, state) -> (topk_ids [R, K], topk_weights [R, K]):
R rows (tokens, or sequences for a per-sequence router), N experts, K = max_k slots; slots beyond a
row's own k get id -1 and weight 0 and are never computed. Ties go to the lower expert index; no noise,
no capacity limit (DESIGN §3).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moe_serve.kernels.ops import AttentionBatch
    from moe_serve.layers.attention import AttentionInputs
    from moe_serve.model_config import RouterConfig

_REGISTRY: dict[str, type[Router]] = {}


def register(kind: str) -> Callable[[type[Router]], type[Router]]:
    def add(cls: type[Router]) -> type[Router]:
        cls.kind = kind
        _REGISTRY[kind] = cls
        return cls

    return add


def router_kinds() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def router_class(kind: str) -> type[Router]:
    return _REGISTRY[kind]


@dataclass(frozen=True, slots=True)
class RouterState:
    """What a stateful router reads besides the logits: the step's tokens (their MoE-layer inputs and where
    each sits in its sequence) and its per-token memory in one MoE layer. Row `slot` of `cache` belongs to
    the token the KV cache keeps at that slot, so the state follows chunked prefill, prefix caching and
    preemption. Without a cache (classify, whole sequences), every sequence is whole in the step."""

    cache: torch.Tensor | None  # [NB * BS, state_size] fp32
    batch: AttentionBatch  # the step's tokens: sequences, positions, block tables, slot mapping
    block_size: int
    inputs: torch.Tensor | None = None  # [T, D] the MoE layer's input of each token of the step
    attention: AttentionInputs | None = None  # the same layer's attention (kinds with reads_attention)
    moe_layer: int = 0  # this block's position in moe.layers (per-layer router settings are in that order)

    def rows_of(self, seq: int, num_tokens: int) -> torch.Tensor:
        """The state rows of a sequence's first num_tokens tokens, in order: [num_tokens] int64."""
        positions = torch.arange(num_tokens, device=self.cache.device)
        table = self.batch.block_tables[seq].long()  # type: ignore[index]
        return table[positions // self.block_size] * self.block_size + positions % self.block_size


class Router(ABC):
    kind: str = ""
    per_sequence: bool = False  # one decision per whole input: the MoE block routes its pooled mean
    # per_sequence kinds: merge the chosen experts' parameters into one expert (SMEAR), or apply each.
    merges_experts: bool = False
    # Whether a top-p policy (moe_serve.moe_policy) is defined for the kind: it picks each token's experts
    # by the full softmax of its own router logits, largest first, so "experts in order of router
    # probability" is its own order. Off unless a kind says so: requests with a policy are then refused.
    top_p_defined: bool = False
    # Whether the kind reads the same layer's attention (its queries, keys, values, scores): RouterState.attention.
    reads_attention: bool = False

    def __init__(self, config: RouterConfig, num_experts: int) -> None:
        self.config = config
        self.num_experts = num_experts

    @classmethod
    def state_size(cls, num_experts: int, hidden_size: int) -> int:
        """Floats the kind keeps per token in the paged cache for the later tokens of the sequence (0: none)."""
        return 0

    @abstractmethod
    def route(
        self, logits: torch.Tensor, top_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> topk_ids [R, K] (-1 beyond a row's k), topk_weights [R, K] fp32."""

    @classmethod
    def is_approximate(cls, k: int, num_experts: int, trained_k: int) -> bool:
        """Whether k is outside what the method defines exactly (flagged in responses); trained_k: the
        model's default k, the one it was trained at."""
        return False
