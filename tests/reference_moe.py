"""A slow, obviously correct MoE layer: plain Python loops over sequences, tokens and chosen experts,
reading the block's weights directly. It shares no code with the fast path: what is particular to a router
kind comes from the kind's own slow reference (Router.reference_weights, Router.reference_scores)."""

from __future__ import annotations

import itertools
import math

import torch
from torch.nn import functional as F

from moe_serve.layers.moe import MoEBlock
from moe_serve.model_config import FFNConfig

ACT = {
    "relu": lambda v: torch.clamp(v, min=0),
    "gelu": lambda v: 0.5 * v * (1 + torch.erf(v / math.sqrt(2))),
    "gelu_tanh": lambda v: 0.5 * v * (1 + torch.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3))),
    "silu": lambda v: v * torch.sigmoid(v),
}


def expert_params(block: MoEBlock, e: int) -> dict[str, torch.Tensor | None]:
    bank = block.experts
    params: dict[str, torch.Tensor | None] = {}
    for name in bank.shapes:
        linear = getattr(bank, name)
        params[name + ".weight"] = linear.weight[e]
        params[name + ".bias"] = None if linear.bias is None else linear.bias[e]
    return params


def run_expert(config: FFNConfig, params: dict[str, torch.Tensor | None], x: torch.Tensor) -> torch.Tensor:
    """One expert on one token vector x [D], written out per kind."""

    def lin(name: str, v: torch.Tensor) -> torch.Tensor:
        w, b = params[name + ".weight"], params[name + ".bias"]
        out = torch.mv(w, v)  # type: ignore[arg-type]
        return out if b is None else out + b

    act = ACT[config.activation]
    if config.kind == "mlp":
        return lin("fc2", act(lin("fc1", x)))
    if config.kind == "glu":
        return lin("down_proj", act(lin("gate_proj", x)) * lin("up_proj", x))
    return lin("up", act(lin("down", x)))


def choose(logits: list[float], k: int) -> list[int]:
    """Top-k indices, largest logit first, ties to the lower index."""
    return sorted(range(len(logits)), key=lambda i: (-logits[i], i))[:k]


def top_p_k(logits: list[float], p: float, min_k: int, max_k: int) -> int:
    """A token's k under a top-p policy, one expert at a time: experts in order of full-softmax
    probability (largest first, ties to the lower index) until their probabilities sum to at least p,
    clamped to [min_k, max_k]; p = 1 takes max_k."""
    if p >= 1.0:
        return max_k
    z = sum(math.exp(v) for v in logits)
    total, n = 0.0, 0
    for i in choose(logits, len(logits)):
        total += math.exp(logits[i]) / z
        n += 1
        if total >= p:
            break
    return min(max(n, min_k), max_k)


def similarity_mix(block: MoEBlock, x: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Similarity-aware routing of one sequence x [T, D] by the kind's own reference (the [T, T] matrix
    written out) -> Q [T, N]."""
    return block.router_kind.reference_scores(x, _router_logits(block, x), causal=causal)  # type: ignore[call-arg]


def _router_logits(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    w, b = block.router.weight.double(), block.router.bias
    return x.double() @ w.T + (0 if b is None else b.double())


def reference_moe(
    block: MoEBlock,
    x: torch.Tensor,
    token_mask: torch.Tensor,
    ks: list[int],
    policies: list[tuple[float, int] | None] | None = None,
    taken: list[list[int]] | None = None,
) -> torch.Tensor:
    """x [B, L, D], token_mask [B, L], ks: k of each sequence -> [B, L, D] (padding rows zero).
    policies: per sequence, None (exactly its k) or (p, min_k): top-p with its k as the max. taken: when
    given, receives the k each token of each sequence took."""
    cfg = block.config
    kind = block.router_kind
    out = torch.zeros_like(x)
    w_router = block.router.weight.double()
    b_router = None if block.router.bias is None else block.router.bias.double()
    for b in range(x.shape[0]):
        positions = [l for l in range(x.shape[1]) if token_mask[b, l]]
        if kind.per_sequence:
            pooled = sum(x[b, l].double() for l in positions) / len(positions)
            if getattr(cfg.router, "input_norm", None) == "layernorm":
                norm = block.router_norm
                pooled = F.layer_norm(pooled, pooled.shape, norm.weight.double(), norm.bias.double(), norm.eps)
            logits = torch.mv(w_router, pooled).tolist()
            chosen = choose(logits, ks[b])
            weights = kind.reference_weights(logits, chosen)
            if not kind.merges_experts:  # each chosen expert applied to every token, with its weight
                for l in positions:
                    token = x[b, l].double()
                    total = sum(
                        w * run_expert(cfg.expert, _double(expert_params(block, e)), token)
                        for e, w in zip(chosen, weights, strict=True)
                    )
                    out[b, l] = total.to(x.dtype)
                continue
            merged: dict[str, torch.Tensor | None] = {}
            for e, w in zip(chosen, weights, strict=True):
                for name, p in expert_params(block, e).items():
                    if p is not None:
                        merged[name] = merged.get(name, 0) + w * p.double()  # type: ignore[operator]
                    else:
                        merged[name] = None
            for l in positions:
                out[b, l] = run_expert(cfg.expert, merged, x[b, l].double()).to(x.dtype)
        else:
            seq = x[b, positions].double()
            mixed = kind.reference_scores(seq, _router_logits(block, seq))
            for i, l in enumerate(positions):
                token = x[b, l].double()
                logits = torch.mv(w_router, token)
                if b_router is not None:
                    logits = logits + b_router
                logits = logits.tolist()
                policy = policies[b] if policies is not None else None
                k = ks[b] if policy is None else top_p_k(logits, policy[0], policy[1], ks[b])
                if taken is not None:
                    taken[b].append(k)
                if mixed is not None:  # top-k of the kind's scores (similarity's mix), weights renormalised
                    q = mixed[i].tolist()
                    chosen = choose(q, k)
                    weights = [q[e] / sum(q[c] for c in chosen) for e in chosen]
                else:
                    chosen = choose(logits, k)
                    weights = kind.reference_weights(logits, chosen)
                y = torch.zeros_like(token)
                for e, w in zip(chosen, weights, strict=True):
                    params = {n: None if p is None else p.double() for n, p in expert_params(block, e).items()}
                    y = y + w * run_expert(cfg.expert, params, token)
                if cfg.hyper_expert is not None:  # HyperMoE: the selected set's adapter, ungated
                    sets = sorted(itertools.combinations(range(cfg.num_experts), k), key=lambda c: c[::-1])
                    bank = block.hyper
                    adapter = {
                        f"{name}.{part}": getattr(getattr(bank, name), part)[sets.index(tuple(sorted(chosen)))].double()
                        for name in ("down", "up")
                        for part in ("weight", "bias")
                    }
                    y = y + run_expert(cfg.hyper_expert, adapter, token)
                out[b, l] = y.to(x.dtype)
        if cfg.shared_expert is not None:
            shared = block.shared_expert
            for l in positions:
                params = {}
                for name in dict(shared.named_children()):
                    linear = getattr(shared, name)
                    params[name + ".weight"] = linear.weight.double()
                    params[name + ".bias"] = None if linear.bias is None else linear.bias.double()
                y = run_expert(cfg.shared_expert, params, x[b, l].double())
                if cfg.shared_expert_gate:
                    y = y * torch.sigmoid(torch.dot(block.shared_expert_gate.weight[0].double(), x[b, l].double()))
                out[b, l] = out[b, l] + y.to(x.dtype)
    return out


def _double(params: dict) -> dict:
    """Expert parameters in float64, as the reference computes."""
    return {name: None if p is None else p.double() for name, p in params.items()}
