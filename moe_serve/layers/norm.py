"""LayerNorm and RMSNorm, computed in fp32 whatever the weight dtype (one fused op when it is fp32)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from moe_serve.kernels import ops
from moe_serve.model_config import NormKind


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.dim = dim  # a constant, not x's traced size: an ONNX LayerNormalization normalises a fixed shape
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(x.float(), (self.dim,), self.weight.float(), self.bias.float(), self.eps)
        return out.to(x.dtype)


def make_norm(kind: NormKind, dim: int, eps: float) -> nn.Module:
    return RMSNorm(dim, eps) if kind == "rmsnorm" else LayerNorm(dim, eps)
