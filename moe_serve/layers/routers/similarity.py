"""`similarity`: Similarity-Aware routing (graph-of-tokens, Nguyen et al. 2025; method card
../shared/methods/graph_routing.md §8, binding). Each token mixes the router distributions of its
sequence's tokens so far, weighted by token similarity, and takes the top k of the mix:

    p_j = softmax(W_g x_j + b_g)                 [N]  x = the MoE layer's input, fp32
    S_i. = softmax_j (x_i . x_j / tau), j <= i        causal, per sequence, includes j = i (W_s = I)
    q_i = sum_j S_ij p_j                              full probabilities mixed; independent of k
    top-k of q_i (ties to the lower id), weights q_i[idx] / sum q_i[idx]

Causal and per request: the graph never spans other sequences or later tokens, so a token's routing is
fixed once computed and its keys and values stay valid. Each token's x_j and p_j are kept in the paged
cache (state_size = D + N floats per token per MoE layer), so chunked prefill, decode, a prefix-cache hit
and recomputation after preemption all route as one full prefill does. q does not depend on k, so every k
is defined; only the trained k (the model's default) was validated, and others are flagged approximate.

Cost: per sequence per MoE layer, one [n, t] score matrix (n tokens of the step, t of the sequence so
far) and one [n, t] x [t, N] mix; the sequence's state rows are gathered once per step. One sequence at a
time, so a row's result never depends on what it is batched with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.config_schema import check_float
from moe_serve.kernels import ops
from moe_serve.kernels.vocabulary import RouteOutput, Weighting
from moe_serve.layers.routers.base import Router, RouterState
from moe_serve.router_registry import RouterConfig, register


@dataclass(frozen=True, slots=True)
class SimilarityConfig(RouterConfig):
    tau: float = 1.0  # temperature of the token-similarity softmax (x_i . x_j / tau)

    def __post_init__(self) -> None:
        RouterConfig.__post_init__(self)
        check_float("router tau", self.tau, 0.0, 1e6, low_open=True)


@register("similarity")
class Similarity(Router):
    Config = SimilarityConfig
    weighting = Weighting.SOFTMAX_CHOSEN  # of log q: q[e] / sum of the chosen q

    def __init__(self, config: RouterConfig, num_experts: int) -> None:
        super().__init__(config, num_experts)
        assert isinstance(config, SimilarityConfig)
        self.tau = config.tau

    @classmethod
    def state_size(cls, num_experts: int, hidden_size: int) -> int:
        return hidden_size + num_experts  # x_j, then p_j

    def route(
        self, logits: torch.Tensor, token_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> RouteOutput:
        if state is None:
            raise ValueError("similarity routing needs the step's tokens and their sequences (a RouterState)")
        return ops.topk_route(mix(logits, state, self.tau).log(), token_k, max_k, self.weighting)

    @classmethod
    def is_approximate(cls, k: int, num_experts: int, trained_k: int) -> bool:
        return k != trained_k

    def reference_scores(self, x: torch.Tensor, logits: torch.Tensor, causal: bool = True) -> torch.Tensor:
        """The whole [n, n] matrix written out: S = the row softmax of x x^T / tau (causal: j <= i), P = the
        router's softmax of each token -> Q = S P [n, N]."""
        scores = x @ x.T / self.tau
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(scores, dim=-1) @ torch.softmax(logits, dim=-1)


def mix(logits: torch.Tensor, state: RouterState, tau: float) -> torch.Tensor:
    """q [T, N] fp32: each token's similarity-weighted mix of its sequence's router distributions."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, N]
    x = state.inputs.float()  # [T, D]
    batch, cache, width = state.batch, state.cache, x.shape[1]
    if cache is not None:  # this step's tokens first: a token sees itself
        cache.index_copy_(0, batch.slot_mapping, torch.cat([x, probs], dim=1))  # type: ignore[arg-type]
    mixed = torch.empty_like(probs)
    start = 0
    for seq, n in enumerate(batch.seq_lens):
        total = batch.num_keys_host[seq]  # tokens of the sequence so far, this step's included
        if cache is not None:
            rows = cache.index_select(0, state.rows_of(seq, total))  # [t, D + N]
            keys, values = rows[:, :width], rows[:, width:]
        else:
            assert total == n, "without a cache every sequence is whole in the step"
            keys, values = x[start : start + n], probs[start : start + n]
        scores = x[start : start + n] @ keys.T / tau  # [n, t]
        # Query i of the step is token total - n + i of the sequence: it sees tokens up to itself.
        visible = torch.ones(n, total, dtype=torch.bool, device=x.device).tril(diagonal=total - n)
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        mixed[start : start + n] = weights @ values
        start += n
    return mixed
