"""The MoE block: a router turning logits into (topk_ids, topk_weights) with k per row, an expert bank,
and an optional (gated) shared expert.

Legend: T tokens, B sequences, L tokens per sequence, N experts, K slots (the batch's largest k), D hidden.

Router rules (DESIGN §3): logits in fp32; ties go to the lower expert index (stable sort); no noise,
no capacity limit. Slots beyond a row's own k get id -1 and weight 0 and are never computed.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from moe_serve.layers.ffn import FFN, ExpertBank
from moe_serve.layers.norm import make_norm
from moe_serve.model_config import MoEConfig, RouterConfig


def route(
    router_logits: torch.Tensor,  # [R, N] fp32, one row per token (or per sequence for soft_merge)
    top_k: torch.Tensor,  # [R] int, the row's k
    max_k: int,  # host int >= every top_k
    config: RouterConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose experts and combine weights for each row -> topk_ids [R, K] (-1 unused), topk_weights [R, K]."""
    sorted_logits, order = torch.sort(router_logits, dim=-1, descending=True, stable=True)  # ties: lower index
    topk_logits, topk_ids = sorted_logits[:, :max_k], order[:, :max_k]  # [R, K]
    used = torch.arange(max_k, device=top_k.device)[None, :] < top_k[:, None]  # [R, K]
    if config.kind == "topk_uniform":
        weights = used.float() / top_k[:, None].float()
    elif config.kind == "topk_softmax" and not config.normalize:
        weights = torch.softmax(router_logits, dim=-1).gather(1, topk_ids) * used
    else:  # topk_softmax normalize=True, and soft_merge (renormalised over the merged experts)
        weights = torch.softmax(topk_logits.masked_fill(~used, float("-inf")), dim=-1)
    return topk_ids.masked_fill(~used, -1), weights


class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig, hidden_size: int, norm_eps: float) -> None:
        super().__init__()
        self.config = config
        self.router = nn.Linear(hidden_size, config.num_experts, bias=config.router.use_bias)
        if config.router.input_norm is not None:
            self.router_norm = make_norm(config.router.input_norm, hidden_size, norm_eps)
        self.experts = ExpertBank(config.expert, hidden_size, config.num_experts)
        if config.shared_expert is not None:
            self.shared_expert = FFN(config.shared_expert, hidden_size)
            if config.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        # Tokens routed to each expert since the last read ([N] int64), when load tracking is on.
        self.expert_load: torch.Tensor | None = None

    def _count(self, topk_ids: torch.Tensor, tokens_per_row: torch.Tensor | None = None) -> None:
        if self.expert_load is None:
            return
        used = topk_ids >= 0
        weights = None if tokens_per_row is None else tokens_per_row[:, None].expand_as(topk_ids)[used].float()
        counts = torch.bincount(topk_ids[used], weights=weights, minlength=self.config.num_experts)
        self.expert_load += counts.to(self.expert_load.dtype)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.router.bias is None else self.router.bias.float()
        return F.linear(x.float(), self.router.weight.float(), bias)

    def forward(
        self,
        x: torch.Tensor,  # [B, L, D]
        token_mask: torch.Tensor,  # [B, L]
        top_k: torch.Tensor,  # [B] experts per token of each sequence
        max_k: int,
    ) -> torch.Tensor:
        if self.config.router.kind == "soft_merge":
            out = self._forward_merged(x, token_mask, top_k, max_k)
        else:
            out = torch.zeros_like(x)
            tokens = x[token_mask]  # [T, D] padding is never routed
            token_k = top_k[:, None].expand_as(token_mask)[token_mask]  # [T]
            topk_ids, topk_weights = route(self.router_logits(tokens), token_k, max_k, self.config.router)
            self._count(topk_ids)
            out[token_mask] = self.experts.forward_grouped(tokens, topk_ids, topk_weights)
        if self.config.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.config.shared_expert_gate:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def _forward_merged(
        self, x: torch.Tensor, token_mask: torch.Tensor, top_k: torch.Tensor, max_k: int
    ) -> torch.Tensor:
        mask = token_mask[..., None].float()  # [B, L, 1]
        pooled = (x.float() * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # [B, D] masked mean
        if self.config.router.input_norm is not None:
            pooled = self.router_norm(pooled)
        topk_ids, topk_weights = route(self.router_logits(pooled), top_k, max_k, self.config.router)
        self._count(topk_ids, token_mask.sum(1))  # every token of a sequence uses its merged experts
        return self.experts.forward_merged(x, topk_ids, topk_weights)
