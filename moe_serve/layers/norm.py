"""LayerNorm and RMSNorm, computed in fp32 whatever the weight dtype."""

from __future__ import annotations

import torch
from torch import nn

from moe_serve.model_config import NormKind


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps)
        return out.to(x.dtype)


def make_norm(kind: NormKind, dim: int, eps: float) -> nn.Module:
    return RMSNorm(dim, eps) if kind == "rmsnorm" else LayerNorm(dim, eps)
