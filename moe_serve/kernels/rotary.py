"""Rotary embedding applied to queries and keys (Hugging Face's rotate-half convention): the one spelling
every torch path uses (the plain-torch reference, the ONNX graph family, latent attention). Its tables are
the model's (moe_serve.layers.positions); the C++ and Triton kernels compute the same rotation fused with
the cache write."""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, Dh]; cos/sin: [T, Dh] (fp32)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    if x.dtype == torch.float32:
        return torch.addcmul(x * cos, rotated, sin)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
