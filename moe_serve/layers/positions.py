"""Position encodings that are computed, not stored: rotary (HF rotate-half convention) and the
Transformer-XL sinusoidal relative embedding. Both are recomputed per call from integer positions, so
the model has no non-persistent buffers and can be built on the meta device."""

from __future__ import annotations

import torch


def rotary_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [*positions.shape, dim] in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim))
    freqs = positions.float()[..., None] * inv_freq  # [..., dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., dim]
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, L, Dh]; cos/sin: [B, L, Dh]."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def sinusoid_relative(distances: torch.Tensor, dim: int) -> torch.Tensor:
    """Transformer-XL relative embedding R[d] = [sin(d w), cos(d w)] for each distance d: [R, dim]."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0.0, dim, 2.0, device=distances.device) / dim))
    angles = distances.float()[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)
