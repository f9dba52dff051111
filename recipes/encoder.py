"""Training-time genre classifiers: a small pre-LN transformer encoder whose FFNs are MoE layers routed by
MOESART, SMEAR or a plain top-k router (the baseline).

Method parts follow the official parameterisations and key names (methods/moesart.md, smear.md):
- MOESART (fairseq layout): `moe.gate.gate_weights.{weight,bias}`, experts `moe.experts.{e}.fc1/fc2`;
  training samples k experts without replacement and re-weights them by the paper's Eq. (3); eval is
  top-k with weights 1/k.
- SMEAR (r-three/smear layout): `moe.adapter_controller.multi_adapters.{down,up}_samplers_*` (input-major,
  leading num_routers dim 1), `multi_routers.router_weights` [1, C, N] with the input LayerNorm and the
  LayerNorm of the router weight; one routing decision per example from the mean-pooled block input,
  expert parameters merged; expert dropout 0.1 in training.
- top-k baseline (MOESART's): the fairseq fork's `TopKGate` (`moe.gate.layer.{weight,bias}`: a linear gate
  with bias), softmax over the top-k logits, experts as MOESART's.
- switch baseline (SMEAR's "Top-k", code `switch_routing`): SMEAR's router and adapters, one decision per
  example, the argmax adapter applied and its output scaled by p_max; no expert dropout.
The backbone (embeddings, attention, norms, head) is this project's own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from moe_serve.evaluation.datasets.shakespeare import GENRES


@dataclass
class EncoderConfig:
    method: str  # moesart | smear | topk | switch
    vocab_size: int = 257
    d_model: int = 128
    n_head: int = 4
    n_layer: int = 4
    max_len: int = 512
    num_experts: int = 8
    d_expert: int = 128  # expert hidden units (SMEAR: adapter bottleneck m)
    k: int = 2  # trained k (MOESART, top-k); SMEAR merges all experts
    tau: float = 1.0  # MOESART temperature
    trimmed_lasso: float = 1e-3  # MOESART's lambda
    expert_dropout: float = 0.1  # SMEAR
    dropout: float = 0.1
    labels: tuple[str, ...] = GENRES

    def to_dict(self) -> dict:
        return asdict(self)


class MOESARTGate(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.gate_weights = nn.Linear(cfg.d_model, cfg.num_experts)
        nn.init.zeros_(self.gate_weights.bias)
        self.k, self.tau, self.lam = cfg.k, cfg.tau, cfg.trimmed_lasso
        self.loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> expert indices [T, k], weights [T, k]."""
        logits = self.gate_weights(x).float() / self.tau
        if not self.training:
            indices = torch.topk(logits, self.k, dim=-1).indices
            return indices, torch.full(indices.shape, 1.0 / self.k, device=x.device)
        g = torch.softmax(logits, dim=-1)
        # k samples without replacement from g (Gumbel-top-k), then Eq. (3) with r = 1.
        gumbel = -torch.log(-torch.log(torch.rand_like(g).clamp(1e-20, 1.0)))
        indices = torch.topk(torch.log(g + 1e-20) + gumbel, self.k, dim=-1).indices  # [T, k]
        o_s, g_s = logits.gather(1, indices), g.gather(1, indices)
        adjusted = o_s - torch.log((self.k - 1) * g_s + 1e-20)
        z = torch.randint(0, self.k, (x.shape[0], 1), device=x.device)  # z uniform over the sampled set
        adjusted = adjusted.scatter(1, z, o_s.gather(1, z))
        weights = torch.softmax(adjusted, dim=-1)
        outside = g.sum(-1) - torch.topk(g, self.k, dim=-1).values.sum(-1)  # trimmed lasso: mass beyond top-k
        self.loss = self.lam * outside.mean()
        return indices, weights


class TopKGate(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.layer = nn.Linear(cfg.d_model, cfg.num_experts, bias=True)  # the fork's TopKGate: bias=True
        self.k = cfg.k
        self.loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = torch.topk(self.layer(x).float(), self.k, dim=-1)
        return indices, torch.softmax(values, dim=-1)


class FairseqExpert(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_expert)
        self.fc2 = nn.Linear(cfg.d_expert, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class TokenMoE(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.gate = MOESARTGate(cfg) if cfg.method == "moesart" else TopKGate(cfg)
        self.experts = nn.ModuleList(FairseqExpert(cfg) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        indices, weights = self.gate(flat)
        dense = torch.zeros(flat.shape[0], len(self.experts), device=x.device).scatter(1, indices, weights)  # [T, N]
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):  # training code: clarity over speed
            rows = torch.nonzero(dense[:, e], as_tuple=True)[0]
            if rows.numel():
                out.index_add_(0, rows, dense[rows, e, None].to(x.dtype) * expert(flat[rows]))
        return out.view_as(x)


class MultiRouters(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.router_weights = nn.Parameter(torch.randn(1, cfg.d_model, cfg.num_experts) * 1e-2)
        self.multi_router_layer_norms = nn.ModuleList([nn.LayerNorm(cfg.d_model)])
        self.multi_router_weights_layer_norms = nn.ModuleList([nn.LayerNorm(cfg.d_model)])
        nn.init.constant_(self.multi_router_weights_layer_norms[0].weight, 1e-2)  # gain init 1e-2, bias 0

    def effective_weight(self) -> torch.Tensor:
        """Column-wise LayerNorm of the router weight over C: input-independent, foldable. [C, N]"""
        norm = self.multi_router_weights_layer_norms[0]
        return norm(self.router_weights[0].t()).t()

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.multi_router_layer_norms[0](pooled) @ self.effective_weight(), dim=-1)


class MultiAdapters(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        n, c, m = cfg.num_experts, cfg.d_model, cfg.d_expert
        self.down_samplers_weights = nn.Parameter(torch.randn(1, n, c, m) * 1e-2)
        self.down_samplers_bias = nn.Parameter(torch.zeros(1, n, m))
        self.up_samplers_weights = nn.Parameter(torch.randn(1, n, m, c) * 1e-2)


class AdapterController(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.multi_adapters = MultiAdapters(cfg)
        self.multi_routers = MultiRouters(cfg)
        self.expert_dropout = cfg.expert_dropout


class SMEAR(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.adapter_controller = AdapterController(cfg)
        # SMEAR merges all N experts. k < N (eval only) merges the top-k with renormalised weights: the
        # serving runtime's approximation, defined here so the exporter test can compare it.
        self.k = cfg.num_experts

    def route(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, L, C] -> the router's p [B, N] from the masked mean (equals the official mean without padding)."""
        m = mask[..., None].to(x.dtype)
        return self.adapter_controller.multi_routers((x * m).sum(1) / m.sum(1).clamp(min=1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ctrl = self.adapter_controller
        p = self.route(x, mask)  # [B, N]
        if self.training and ctrl.expert_dropout > 0:
            keep = (torch.rand_like(p) > ctrl.expert_dropout).to(p.dtype)
            p = (p * keep + 1e-10) / (p * keep + 1e-10).sum(-1, keepdim=True)
        elif self.k < p.shape[-1]:
            values, indices = torch.topk(p, self.k, dim=-1)
            p = torch.zeros_like(p).scatter(1, indices, values / values.sum(-1, keepdim=True))
        adapters = ctrl.multi_adapters
        down = torch.einsum("bn,ncm->bcm", p, adapters.down_samplers_weights[0])
        bias = p @ adapters.down_samplers_bias[0]
        up = torch.einsum("bn,nmc->bmc", p, adapters.up_samplers_weights[0])
        return torch.bmm(F.silu(torch.bmm(x, down) + bias[:, None, :]), up)


class Switch(SMEAR):
    """SMEAR's "Top-k" baseline (`switch_routing`): the same router and adapters; each example's top-k
    adapters by p, each applied (not merged) and its output scaled by its p (k = 1 in the paper: argmax x
    p_max; p is not renormalised). No expert dropout (the paper's plain Top-k row)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__(cfg)
        self.adapter_controller.expert_dropout = 0.0
        self.k = 1

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        p = self.route(x, mask)  # [B, N]
        values, indices = torch.topk(p, self.k, dim=-1)
        adapters = self.adapter_controller.multi_adapters
        out = torch.zeros_like(x)
        for slot in range(self.k):
            e = indices[:, slot]
            down, bias = adapters.down_samplers_weights[0, e], adapters.down_samplers_bias[0, e]  # [B, C, m], [B, m]
            h = F.silu(torch.bmm(x, down) + bias[:, None, :])
            out = out + values[:, slot, None, None] * torch.bmm(h, adapters.up_samplers_weights[0, e])
        return out


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.self_attn = nn.MultiheadAttention(cfg.d_model, cfg.n_head, dropout=cfg.dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.moe = {"smear": SMEAR, "switch": Switch}.get(cfg.method, TokenMoE)(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.norm1(h)
        h = h + self.drop(self.self_attn(x, x, x, key_padding_mask=~mask, need_weights=False)[0])
        return h + self.drop(self.moe(self.norm2(h), mask))


class GenreClassifier(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.max_len, cfg.d_model)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        nn.init.normal_(self.embed_positions.weight, std=0.02)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, len(cfg.labels))

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """tokens, mask [B, L] -> class logits [B, C] (mean pool over real tokens)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed_tokens(tokens) + self.embed_positions(positions)[None]
        for layer in self.layers:
            h = layer(h, mask)
        h = self.norm(h)
        m = mask[..., None].to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp(min=1))

    def aux_loss(self) -> torch.Tensor:
        return sum(
            (getattr(layer.moe, "gate", None).loss for layer in self.layers if hasattr(layer.moe, "gate")),
            torch.zeros(()),
        )

    def set_k(self, k: int) -> None:
        for layer in self.layers:
            target = layer.moe.gate if hasattr(layer.moe, "gate") else layer.moe
            target.k = k
