"""`attention`: Attention-Aware routing (graph-of-tokens, A2 routing; method card graph_routing.md §8,
binding). Each token mixes the router distributions of its sequence's tokens so far, weighted by the
posterior attention of one head h* of the same layer (fixed per layer: `router.heads`, policy A):

    p_j     = softmax(W_g x~_j + b_g)                      x~ = the MoE layer's input, fp32
    c_j     = ||W_O^h v_j||^2                              v_j = head h's value of token j, W_O^h its slice of o_proj
    k_ij    = s_ij + (W_O^hT x~_i) . v_j / sigma^2 - c_j / (2 sigma^2)
    A^_i.   = softmax_j k_ij over the attention's support, causal (j <= i)
    q_i     = sum_j A^_ij p_j;  top-k of q_i (ties to the lower id), weights q_i[idx] / sum q_i[idx]

with s_ij exactly the backbone's score for head h (scale, rotary or Transformer-XL relative terms
included). This is Lemma 1's posterior A^ = A L / sum(A L) with the likelihood L = exp(-||x~_i - W_O^h
v_j||^2 / (2 sigma^2)): the row-constant ||x~_i||^2 cancels in the softmax.

State per token per MoE layer in the paged cache: p_j and c_j (N + 1 floats); keys and values are read
from the layer's own KV cache, so prefill, chunks, decode, a prefix-cache hit and recomputation route
alike. Causal and per request, one sequence at a time (a row never depends on its batch). q does not
depend on k: every k is defined, only the trained k (the model's default) is validated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moe_serve.config_schema import check_float
from moe_serve.errors import ConfigError
from moe_serve.kernels import ops
from moe_serve.kernels.vocabulary import RouteOutput, Weighting, gather_sequence
from moe_serve.layers.routers.base import Router, RouterState
from moe_serve.router_registry import RouterConfig, register

if TYPE_CHECKING:
    from moe_serve.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class AttentionAwareConfig(RouterConfig):
    sigma: float = 1.0  # width of the likelihood term exp(-||x~_i - W^h x_j||^2 / (2 sigma^2))
    heads: tuple[int, ...] = ()  # h*, the head each MoE layer routes by (in moe.layers order)

    def __post_init__(self) -> None:
        RouterConfig.__post_init__(self)
        check_float("router sigma", self.sigma, 0.0, 1e6, low_open=True)


@register("attention")
class AttentionAware(Router):
    Config = AttentionAwareConfig
    weighting = Weighting.SOFTMAX_CHOSEN  # of log q: q[e] / sum of the chosen q
    reads_attention = True

    def __init__(self, config: RouterConfig, num_experts: int) -> None:
        super().__init__(config, num_experts)
        assert isinstance(config, AttentionAwareConfig)
        self.heads, self.sigma = config.heads, config.sigma

    @classmethod
    def state_size(cls, num_experts: int, hidden_size: int) -> int:
        return num_experts + 1  # p_j, then c_j

    @classmethod
    def check_model(cls, config: ModelConfig) -> None:
        super().check_model(config)
        assert config.moe is not None and isinstance(config.moe.router, AttentionAwareConfig)
        heads = config.moe.router.heads
        valid = all(isinstance(h, int) and 0 <= h < config.num_heads for h in heads)
        if len(heads) != len(config.moe.layers) or not valid:
            raise ConfigError(
                f"router kind attention needs router.heads: one head in 0..{config.num_heads - 1} per MoE layer "
                f"(its h*, in moe.layers order; {len(config.moe.layers)} layers); got {list(heads)}"
            )

    def route(
        self, logits: torch.Tensor, token_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> RouteOutput:
        if state is None or state.attention is None:
            raise ValueError("attention-aware routing needs the layer's attention and the step's tokens")
        head = self.heads[state.moe_layer]
        return ops.topk_route(mix(logits, state, head, self.sigma).log(), token_k, max_k, self.weighting)

    @classmethod
    def is_approximate(cls, k: int, num_experts: int, trained_k: int) -> bool:
        return k != trained_k


def mix(logits: torch.Tensor, state: RouterState, head: int, sigma: float) -> torch.Tensor:
    """q [T, N] fp32: each token's mix of its sequence's router distributions by head `head`'s posterior
    attention."""
    att = state.attention
    assert att is not None
    num_heads, num_kv_heads, dh = att.q.shape[1], att.k.shape[1], att.q.shape[2]
    group = head // (num_heads // num_kv_heads)
    w_o = att.o_weight[:, head * dh : (head + 1) * dh].float()  # [D, Dh]
    probs = torch.softmax(logits.float(), dim=-1)  # [T, N]
    cost = (att.v[:, group].float() @ w_o.T).pow(2).sum(-1)  # c_j [T]
    u = state.inputs.float() @ w_o  # W_O^hT x~_i [T, Dh]
    batch, cache = state.batch, state.cache
    if cache is not None:
        cache.index_copy_(0, batch.slot_mapping, torch.cat([probs, cost[:, None]], dim=1))  # type: ignore[arg-type]
    mixed = torch.empty_like(probs)
    start = 0
    for seq, n in enumerate(batch.seq_lens):
        total = batch.num_keys_host[seq]
        rows = slice(start, start + n)
        if cache is not None:
            assert att.cache is not None
            keys, values = gather_sequence(att.cache, batch.block_tables[seq], total)  # type: ignore[index]
            stored = cache.index_select(0, state.rows_of(seq, total))
            past_probs, past_cost = stored[:, :-1], stored[:, -1]
        else:
            assert total == n, "without a cache every sequence is whole in the step"
            keys, values, past_probs, past_cost = att.k[rows], att.v[rows], probs[rows], cost[rows]
        keys, values = keys[:, group].float(), values[:, group].float()  # [t, Dh]
        query_pos = batch.positions[rows]
        key_pos = torch.arange(total, device=keys.device)
        scores = att.q[rows, head].float() @ keys.T  # [n, t]
        if att.relative is not None:
            distance = (query_pos[:, None] - key_pos[None, :] + att.relative.offset).clamp(
                0, att.relative.r_k.shape[0] - 1
            )
            r_k = att.relative.r_k[:, head].float()[distance]  # [n, t, Dh]
            scores = scores + torch.einsum("nd,ntd->nt", att.relative.q_rel[rows, head].float(), r_k)
        kappa = scores * att.scale + (u[rows] @ values.T - past_cost[None, :] / 2) / sigma**2
        visible = key_pos[None, :] <= query_pos[:, None]
        weights = torch.softmax(kappa.masked_fill(~visible, float("-inf")), dim=-1)
        mixed[rows] = weights @ past_probs
        start += n
    return mixed


def reference_mix(
    q: torch.Tensor,  # [n, Dh] head h's queries (as the attention kernel saw them)
    k: torch.Tensor,  # [n, Dh] its key/value group's keys
    v: torch.Tensor,  # [n, Dh] and values
    positional: torch.Tensor | None,  # [n, n] the Transformer-XL term q_rel_i . r_k[i - j], or None
    scale: float,
    w_o: torch.Tensor,  # [D, Dh] head h's slice of the output projection
    x: torch.Tensor,  # [n, D] the MoE layer's inputs
    probs: torch.Tensor,  # [n, N] the router's softmax of each token
    sigma: float,
    causal: bool = True,
) -> torch.Tensor:
    """Attention-aware routing of one sequence from Lemma 1, every matrix written out: the head's attention
    A (causal softmax of its scores), the likelihood L_ij = exp(-||x_i - W_O v_j||^2 / (2 sigma^2)), the
    posterior A^ = A L / sum_j A L -> Q = A^ P [n, N]."""
    q, k, v, w_o, x, probs = (t.double() for t in (q, k, v, w_o, x, probs))
    scores = q @ k.T + (0 if positional is None else positional.double())
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    attention = torch.softmax(scores * scale, dim=-1)
    distance = ((x[:, None, :] - (v @ w_o.T)[None, :, :]) ** 2).sum(-1)  # [n, n] ||x_i - W_O v_j||^2
    posterior = attention * torch.exp(-(distance - distance.min(dim=1, keepdim=True).values) / (2 * sigma**2))
    return (posterior / posterior.sum(dim=1, keepdim=True)) @ probs
